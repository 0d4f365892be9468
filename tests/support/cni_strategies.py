"""Hypothesis strategies for CNI network configs: values, fields and IPAM ranges to fuzz."""

from __future__ import annotations

from hypothesis import strategies as st

from cni.ipam.hostlocal import IPAM_KEYS
from cni.netconf import BRIDGE_OPTIONS, RUNTIME_KEYS

ADDRESSES = st.sampled_from(
    ["10.9.0.5", "10.9.0.5/24", "10.9.0.0", "10.9.0.255", "fd09::5", "fd09::/64", "10.9.0.0/24"]
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=12)
    | ADDRESSES
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
TOP_FIELDS = sorted(RUNTIME_KEYS | set(BRIDGE_OPTIONS) | {"unknownOption"})
IPAM_FIELDS = sorted(IPAM_KEYS | {"unknownOption"})
RANGE = st.fixed_dictionaries(
    {}, optional={k: ADDRESSES | VALUES for k in ("subnet", "rangeStart", "rangeEnd", "gateway")}
)
