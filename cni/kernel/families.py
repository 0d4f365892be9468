"""The IP versions knit handles and their socket address families, named once for the plugin
and the node daemon."""

from __future__ import annotations

import socket

IP_FAMILIES = (4, 6)
ADDRESS_FAMILIES = {4: socket.AF_INET, 6: socket.AF_INET6}
