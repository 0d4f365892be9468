"""NetworkPolicy enforcement for the pods of this node, in nftables whatever the proxy mode."""
