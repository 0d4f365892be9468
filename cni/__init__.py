"""knit CNI plugin: bridge networking with host-local IPAM, spec 1.1."""
