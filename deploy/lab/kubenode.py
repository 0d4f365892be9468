"""A real Kubernetes node in the lab: containerd and kubelet in the node's own namespaces.

The node's machine (deploy/lab/machine.py) gives it a network namespace on an underlay segment,
a private mount namespace in which /etc/cni, /opt/cni, /var/lib, /var/log and /run are its own
folders, and a cgroup. containerd (deploy/lab/runtime.py) and kubelet run there; kubelet
registers the Node, kube-controller-manager gives it podCIDRs, and the pods it runs (knit's
DaemonSet first of all) get their network from whatever CNI config the node holds.

Facts of this machine that shape the kubelet configuration: cgroups are v1 (failCgroupV1 false,
the cgroupfs driver), there is no systemd, swap may be on, and the disk is shared with the
host (eviction thresholds low, image garbage collection off: the images are imported, not
pulled, and could not come back).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.lab.controlplane import issue_client, kubeconfig_for, write_kubeconfig
from deploy.lab.machine import Machine
from deploy.lab.paths import CONTROLPLANE_BIN, REFERENCE_PLUGINS
from deploy.lab.process import terminate
from deploy.lab.runtime import CNI_BIN_DIR, SOCKET, Containerd

KUBELET = CONTROLPLANE_BIN / "kubelet"
# containerd brings up a pod's lo with the reference loopback plugin, which a node's OS
# provides (kind's node image, kubeadm's kubernetes-cni package), not the pod network
LOOPBACK = REFERENCE_PLUGINS / "loopback"
CLUSTER_DNS = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"


# kubelet started again whenever it exits, as a node's service manager does (kubeadm's unit:
# Restart=always, 10 s apart): a kubelet that finds containerd's CRI not serving yet exits at
# once ("server is not initialized yet"), as it did after a lab node's reboot in a chaos run,
# leaving the node NotReady for good. The pid spawned is this loop's; stopping its process
# group stops the kubelet too.
SUPERVISE = """
while :; do
    "$@"
    echo "kubelet exited ($?); starting it again in 2 s" >&2
    sleep 2
done
"""


def kubelet_config(address: str, cgroup_root: str, pki: Path, resolv_conf: Path) -> dict[str, Any]:
    """KubeletConfiguration for a lab node (pure)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "containerRuntimeEndpoint": f"unix://{SOCKET}",
        "address": address,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDomain": CLUSTER_DOMAIN,
        "clusterDNS": [CLUSTER_DNS],
        "resolvConf": str(resolv_conf),
        "failSwapOn": False,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "rotateCertificates": False,
        "protectKernelDefaults": False,
    }


@dataclass
class KubeNode:
    """A node's machine, its containerd and its kubelet."""

    name: str
    machine: Machine
    addresses: tuple[str, str]
    containerd: Containerd
    containerd_pid: int = 0
    containerd_started: float = 0.0
    """time.monotonic() when containerd was last started: when the node's boot began."""
    kubelet_pid: int = 0

    @property
    def folder(self) -> Path:
        return self.machine.folder

    @property
    def socket(self) -> Path:
        """containerd's socket as the host sees it."""
        return self.folder / SOCKET.removeprefix("/")

    def ctr(self, *argv: str) -> list[str]:
        """A ctr command line for this node's containerd, in the CRI's namespace."""
        return ["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *argv]

    def start_containerd(self) -> None:
        self.machine.run("install", "-D", str(LOOPBACK), f"{CNI_BIN_DIR}/loopback")
        config = self.folder / "containerd.toml"
        config.write_text(self.containerd.config)
        path = f"{self.containerd.shim_dir}:/usr/sbin:/usr/bin:/sbin:/bin"
        self.socket.unlink(missing_ok=True)  # one a killed containerd left
        self.containerd_started = time.monotonic()
        self.containerd_pid = self.machine.spawn(
            [str(self.containerd.binary), "--config", str(config)],
            self.folder / "containerd.log",
            env={"PATH": path},
        )
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: containerd did not start; see its log")
            time.sleep(0.05)

    def start_kubelet(self, pki: Path, server: str) -> None:
        """kubelet with a client certificate as system:node:NAME, talking to server."""
        user = f"node-{self.name}"
        if not (pki / f"{user}.crt").exists():
            issue_client(pki, user, f"system:node:{self.name}", "system:nodes")
        kubeconfig = write_kubeconfig(
            self.folder / "kubelet.kubeconfig", kubeconfig_for(pki, server, user)
        )
        resolv_conf = self.folder / "resolv.conf"
        # the node's resolver: nothing outside the lab answers, and pods with dnsPolicy
        # Default (CoreDNS itself) must not be sent anywhere else
        resolv_conf.write_text("options ndots:1\n")
        config = self.folder / "kubelet.yaml"
        cgroup_root = "/" + self.machine.cgroup.path
        config.write_text(
            json.dumps(kubelet_config(self.addresses[0], cgroup_root, pki, resolv_conf))
        )
        self.kubelet_pid = self.machine.spawn(
            [
                "sh", "-c", SUPERVISE, "sh",
                str(KUBELET),
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--hostname-override={self.name}",
                f"--node-ip={','.join(self.addresses)}",
            ],
            self.folder / "kubelet.log",
        )  # fmt: skip

    def restart(self, pki: Path, server: str) -> None:
        """kubelet and containerd stopped and started again, as a node's service manager
        would; the pods' processes (under their shims) go on."""
        for pid in (self.kubelet_pid, self.containerd_pid):
            terminate(pid)
        self.start_containerd()
        self.start_kubelet(pki, server)
