"""Test doubles and world helpers shared by the test modules, which import one another never.

- cni_env: a node namespace with pods attached through the plugin, and what a test inspects.
- cni_strategies: hypothesis strategies for CNI network configs.
- example_service: one example service port and node, and the tracker's changes for ports.
- fastpath: the CNI fast path's wire format and its compiled client, from the tests' side.
- fastpath_daemon: the fast path's daemon in a node namespace, and calls through it.
- hostile_objects: API objects at the limits the API server accepts.
- ipvs_doubles: a fake IPVS table behind pyroute2.IPVS's two methods.
- netlink_script: the kernel's side of a netlink socket, scripted.
- proxy_env: a node namespace running knit-proxyd, and the Services tests create.
"""
