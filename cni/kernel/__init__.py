"""The kernel layer the plugin and the node daemon share: netlink sockets and messages
(rawnetlink), the node's addresses (addresses), network namespaces (netns), sysctls (sysctl),
iptables and its flavours (firewall), nftables through libnftables (nftables).

It imports nothing else of knit, and its failures are its own (errors.KernelError and
RawNetlinkError, both OSErrors): the plugin turns them into CNI error codes at its edge
(cni.plugin.cni_error), the daemon logs or retries them. It sits under cni/ because the
plugin's bundle ships the cni package alone."""
