"""The IPVS datapath: virtual servers through netlink, ipsets, a few set-based iptables rules."""
