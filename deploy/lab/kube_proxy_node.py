"""The real kube-proxy (built from the pinned kubernetes module) started inside a node
namespace: the peer the benches measure knit-proxyd beside, with the same node name, API server
and cluster CIDR knit-proxyd gets there."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from deploy.lab.controlplane import die_with_parent
from deploy.lab.netns import Netns
from deploy.lab.paths import CONTROLPLANE_BIN

KUBE_PROXY = CONTROLPLANE_BIN / "kube-proxy"


def kube_proxy_config(
    kubeconfig: Path,
    node: str,
    cluster_cidr: str,
    mode: str,
    metrics_address: str,
    **settings: object,
) -> dict[str, object]:
    """A KubeProxyConfiguration of kube-proxy's defaults but for where it runs (node `node`
    in `mode`, its metrics at metrics_address) and the fields in `settings`.
    `conntrack.maxPerCore: 0` leaves nf_conntrack_max alone: that sysctl belongs to the host's
    namespace, read-only from a node's, where kube-proxy would otherwise fail to start.
    oomScoreAdj 0: lowering it needs CAP_SYS_RESOURCE, which this machine's bounding set
    lacks."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": mode,
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": node,
        "clusterCIDR": cluster_cidr,
        "metricsBindAddress": metrics_address,
        "conntrack": {"maxPerCore": 0},
        "oomScoreAdj": 0,
        **settings,
    }


def launch_kube_proxy(
    ns: Netns, config: dict[str, object], folder: Path, log: Path
) -> subprocess.Popen[bytes]:
    """kube-proxy in ns with `config` (written into folder), logging at -v=2 (the level of its
    "Syncing ... rules" and "SyncProxyRules complete" lines) to log, killed when the launching
    thread ends. `ip netns exec` execs it, so the process's pid is kube-proxy's."""
    path = folder / "kube-proxy.json"
    path.write_text(json.dumps(config, indent=2))
    with log.open("ab") as out:
        return subprocess.Popen(
            ["ip", "netns", "exec", ns.name, str(KUBE_PROXY), "--config", str(path), "-v=2"],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
