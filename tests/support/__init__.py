"""Test doubles and world helpers shared by the test modules, which import one another never.

- cni_env: a node namespace with pods attached through the plugin, and what a test inspects.
- example_service: one example service port and node for the datapaths' rendering tests.
- fastpath: the CNI fast path's wire format and its compiled client, from the tests' side.
- hostile_objects: API objects at the limits the API server accepts.
- netlink_script: the kernel's side of a netlink socket, scripted.
- proxy_env: a node namespace running knit-proxyd against the real control plane.
"""
