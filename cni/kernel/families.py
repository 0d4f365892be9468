"""The IP versions knit handles and their socket address families, named once for the plugin
and the node daemon."""

from __future__ import annotations

import _socket  # not socket: see cni.kernel.rawnetlink

IP_FAMILIES = (4, 6)
ADDRESS_FAMILIES = {4: _socket.AF_INET, 6: _socket.AF_INET6}
