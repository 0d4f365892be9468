"""containerd on a lab node: its configuration (pure) for the two lines nodes run.

containerd 1.6 and 1.7 (Debian's package; config version 2) are what many nodes still run, and
their libcni predates CNI version negotiation; containerd 2.x (built from the pinned module;
config version 3) negotiates. The lab runs both, so knit's conflist is proven against each.

Paths are the standard ones (/var/lib/containerd, /run/containerd, /etc/cni/net.d, /opt/cni/bin):
inside the node's mount namespace they are the node's own folders (deploy/lab/machine.py).
Settings this machine needs, for both lines:
- restrict_oom_score_adj: the machine's bounding set lacks CAP_SYS_RESOURCE, and runc fails every
  sandbox when it may not lower a process's oom_score_adj ("can't get final child's PID");
- netns_mounts_under_state_dir: pods' network namespaces under /run/containerd (the node's own
  /run), not in a shared /var/run/netns;
- SystemdCgroup false: no systemd here; kubelet uses the cgroupfs driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deploy.lab.paths import NODE_BIN

PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"
SOCKET = "/run/containerd/containerd.sock"
CNI_CONF_DIR = "/etc/cni/net.d"
CNI_BIN_DIR = "/opt/cni/bin"


def config_v2() -> str:
    """containerd 1.6/1.7's CRI settings."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
[{cri}.containerd]
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{CNI_CONF_DIR}"
"""


def config_v3() -> str:
    """containerd 2.x's CRI settings (the CRI plugin split into images and runtime)."""
    images = 'plugins."io.containerd.cri.v1.images"'
    runtime = 'plugins."io.containerd.cri.v1.runtime"'
    return f"""version = 3
[{images}.pinned_images]
  sandbox = "{PAUSE_IMAGE}"
[{runtime}]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
[{runtime}.containerd]
  default_runtime_name = "runc"
[{runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{runtime}.containerd.runtimes.runc.options]
  SystemdCgroup = false
[{runtime}.cni]
  bin_dirs = ["{CNI_BIN_DIR}"]
  conf_dir = "{CNI_CONF_DIR}"
"""


@dataclass(frozen=True)
class Containerd:
    """A containerd to run: its binary, the folder of its shim (first on its PATH) and its
    configuration."""

    name: str
    binary: Path
    config: str

    @property
    def shim_dir(self) -> Path:
        return self.binary.parent


DEBIAN = Containerd("containerd 1.6 (Debian)", Path("/usr/bin/containerd"), config_v2())
BUILT = Containerd("containerd 2.x", NODE_BIN / "containerd", config_v3())
