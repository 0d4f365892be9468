"""Node networking: the CNI config, routes to the other nodes' pods, egress masquerade."""
