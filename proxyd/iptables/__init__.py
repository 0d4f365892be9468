"""The iptables datapath: rules rendered from the model, applied with iptables-restore."""
