"""A real Kubernetes control plane on host loopback (etcd + kube-apiserver) for tests and the lab.

`start(state_dir)` makes a CA and certificates with the openssl CLI, starts etcd and
kube-apiserver on 127.0.0.1 with free ports (data, logs and pids under state_dir), waits for
/readyz and writes an admin kubeconfig. deploy/lab/relay.py makes it reachable inside a
network namespace.

CLI: `up --dir DIR` leaves both processes running; `down --dir DIR` stops them and removes
what `up` wrote to DIR.
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deploy.lab.paths import CONTROLPLANE_BIN

SERVICE_CIDRS = ("10.96.0.0/16", "fd00:10:96::/112")
NODE_PORT_RANGE = "30000-32767"
ADMIN = "knit-admin"
PROCESSES = ("etcd", "kube-apiserver")
# a whole cluster's controllers (start_controllers), stopped by `down` like the two above
CONTROLLERS = ("kube-controller-manager", "kube-scheduler")
KUBERNETES_SERVICE = "/api/v1/namespaces/default/services/kubernetes"
# Everything start() writes into the state dir; `down` removes exactly these.
STATE = (
    "pki",
    "etcd-data",
    "admin.kubeconfig",
    "egress.yaml",
    *(f"{name}.kubeconfig" for name in CONTROLLERS),
    *(f"{name}.{suffix}" for name in PROCESSES + CONTROLLERS for suffix in ("log", "pid")),
)
STOP_GRACE = 10.0
PR_SET_PDEATHSIG = 1


class ControlPlaneError(RuntimeError):
    pass


# ---------------------------------------------------------------- certificates


def _openssl(pki: Path, command: str) -> None:
    """Run `openssl COMMAND` in pki (file names in COMMAND are relative to it)."""
    try:
        result = subprocess.run(
            ["openssl", *command.split()], cwd=pki, capture_output=True, text=True
        )
    except FileNotFoundError as err:
        raise ControlPlaneError("openssl is not installed (`make setup` installs it)") from err
    if result.returncode != 0:
        raise ControlPlaneError(f"openssl {command} failed: {result.stderr.strip()}")


def _issue(pki: Path, name: str, subject: dict[str, str], extensions: dict[str, str]) -> None:
    """pki/NAME.key (P-256) and pki/NAME.crt, signed by pki/ca (self-signed when NAME is ca)."""
    (pki / f"{name}.cnf").write_text(
        "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\n"
        + "".join(f"{key} = {value}\n" for key, value in subject.items())
        + "[ext]\n"
        + "".join(f"{key} = {value}\n" for key, value in extensions.items())
    )
    request = f"req -new -config {name}.cnf -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256"
    if name == "ca":
        _openssl(pki, f"{request} -keyout ca.key -x509 -extensions ext -days 3650 -out ca.crt")
    else:
        _openssl(pki, f"{request} -keyout {name}.key -out {name}.csr")
        serial = f"0x{secrets.token_hex(16)}"
        _openssl(
            pki,
            f"x509 -req -in {name}.csr -CA ca.crt -CAkey ca.key -set_serial {serial} -days 3650"
            f" -extfile {name}.cnf -extensions ext -out {name}.crt",
        )
        (pki / f"{name}.csr").unlink()
    (pki / f"{name}.cnf").unlink()


LEAF = {"basicConstraints": "critical,CA:FALSE", "keyUsage": "critical,digitalSignature"}
# client certificates every control plane gets: (file name, CN, O)
CLIENTS = (
    ("admin", ADMIN, "system:masters"),
    # the apiserver's own identity towards kubelets (logs, exec, port-forward)
    ("kubelet-client", "kube-apiserver-kubelet-client", "system:masters"),
    ("controller-manager", "system:kube-controller-manager", ""),
    ("scheduler", "system:kube-scheduler", ""),
)


def issue_client(pki: Path, name: str, user: str, group: str = "") -> None:
    """pki/NAME.crt and .key: a client certificate for user (CN) in group (O)."""
    subject = {"CN": user, **({"O": group} if group else {})}
    _issue(pki, name, subject, {**LEAF, "extendedKeyUsage": "clientAuth"})


def make_pki(pki: Path, service_cidrs: Sequence[str], addresses: Sequence[str] = ()) -> None:
    """CA, apiserver serving cert (also for addresses), the control plane's client certs and
    the service-account key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    ca = {"basicConstraints": "critical,CA:TRUE", "keyUsage": "critical,keyCertSign,cRLSign"}
    _issue(pki, "ca", {"CN": "knit-ca"}, ca)
    domains = ("", ".default", ".default.svc", ".default.svc.cluster.local")
    names = ["localhost"] + [f"kubernetes{domain}" for domain in domains]
    ips = ["127.0.0.1", "::1", *addresses]
    ips += [str(ipaddress.ip_network(cidr)[1]) for cidr in service_cidrs]
    sans = ",".join([f"DNS:{name}" for name in names] + [f"IP:{ip}" for ip in ips])
    serving = {**LEAF, "extendedKeyUsage": "serverAuth", "subjectAltName": sans}
    _issue(pki, "apiserver", {"CN": "kube-apiserver"}, serving)
    for name, user, group in CLIENTS:
        issue_client(pki, name, user, group)
    _openssl(pki, "genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out sa.key")
    _openssl(pki, "pkey -in sa.key -pubout -out sa.pub")


def kubeconfig_for(pki: Path, server: str, user: str = "admin") -> dict[str, object]:
    """A kubeconfig for server as the client certificate pki/USER.crt, naming the CA and
    client cert files in pki rather than embedding them: the Python client copies embedded
    ones to /tmp files that stay there when a process using it is killed."""
    pki = pki.resolve()
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "knit",
                "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate": str(pki / f"{user}.crt"),
                    "client-key": str(pki / f"{user}.key"),
                },
            }
        ],
        "contexts": [{"name": "knit", "context": {"cluster": "knit", "user": user}}],
        "current-context": "knit",
    }


# ---------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


_prctl = ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent() -> None:
    """In the child before exec: no locks taken, the libc function was looked up beforehand."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _tail(log: Path, lines: int = 30) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _runs(pid: int, name: str) -> bool:
    """Whether pid is still a live NAME process (not reused, not a zombie)."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return Path(argv0.decode(errors="replace")).name == name


def _stop_pid(pid: int, name: str) -> None:
    """_stop for a process that is not our child: signal it, then poll until it is gone."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, STOP_GRACE)):
        if not _runs(pid, name):
            return
        os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while _runs(pid, name) and time.monotonic() < deadline:
            time.sleep(0.05)
    if _runs(pid, name):
        raise ControlPlaneError(f"{name} (pid {pid}) survived SIGKILL")


@dataclass
class ControlPlane:
    state_dir: Path
    port: int
    etcd_port: int
    processes: list[subprocess.Popen[bytes]]
    etcd_seconds: float = 0.0
    apiserver_seconds: float = 0.0
    host: str = "127.0.0.1"
    """Where this process reaches the apiserver: host loopback, unless attached() names
    another address."""

    @property
    def server(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}"

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "admin.kubeconfig"

    def write_kubeconfig(self, path: Path, port: int | None = None) -> Path:
        """An admin kubeconfig for https://127.0.0.1:PORT (default: the apiserver's own port);
        with a relay's listen_port (deploy/lab/relay.py), it is the kubeconfig to use inside
        that namespace."""
        return write_kubeconfig(
            path, kubeconfig_for(self.state_dir / "pki", f"https://127.0.0.1:{port or self.port}")
        )

    def stop(self) -> None:
        for proc in reversed(self.processes):
            _stop(proc)


def attached(state_dir: Path) -> ControlPlane:
    """A control plane started elsewhere (`make controlplane`, or the host of a VM node), known
    by its state dir: pki/ and admin.kubeconfig, whose server gives its address and port.
    stop() leaves it running."""
    config = json.loads((state_dir / "admin.kubeconfig").read_text())
    server = urllib.parse.urlsplit(config["clusters"][0]["cluster"]["server"])
    if server.hostname is None or server.port is None:
        raise ControlPlaneError(f"{state_dir / 'admin.kubeconfig'}: no address and port")
    return ControlPlane(state_dir, server.port, 0, [], host=server.hostname)


def write_kubeconfig(path: Path, config: dict[str, object]) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(config, out, indent=2)
    return path


def _launch(
    state_dir: Path, bin_dir: Path, name: str, args: list[str], detach: bool
) -> subprocess.Popen[bytes]:
    with (state_dir / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(
            [str(bin_dir / name), *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=None if detach else die_with_parent,
        )
    (state_dir / f"{name}.pid").write_text(f"{proc.pid}\n")
    return proc


def _wait_ready(
    proc: subprocess.Popen[bytes],
    log: Path,
    check: http.client.HTTPConnection,
    path: str,
    deadline: float,
) -> None:
    """Poll GET path until it answers 200; ControlPlaneError with the log tail otherwise."""
    name = log.stem
    while True:
        if proc.poll() is not None:
            raise ControlPlaneError(f"{name} exited with {proc.returncode}:\n{_tail(log)}")
        try:
            check.request("GET", path)
            response = check.getresponse()
            response.read()
            if response.status == 200:
                return
        except (OSError, http.client.HTTPException):
            pass
        finally:
            check.close()
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"{name} not ready on {path} in time:\n{_tail(log)}")
        time.sleep(0.1)


def _apiserver_check(pki: Path, port: int) -> http.client.HTTPSConnection:
    """A connection to the apiserver on port as its admin, for _wait_ready."""
    tls = ssl.create_default_context(cafile=pki / "ca.crt")
    tls.load_cert_chain(pki / "admin.crt", pki / "admin.key")
    return http.client.HTTPSConnection("127.0.0.1", port, timeout=2, context=tls)


def _etcd_args(state_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        "--name=knit",
        f"--data-dir={state_dir / 'etcd-data'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=knit={peer}",
        # a throw-away store on one machine: no fsync, as the Kubernetes test harness does
        "--unsafe-no-fsync",
    ]


@dataclass(frozen=True)
class Reach:
    """How a cluster of real nodes reaches the apiserver and the apiserver its kubelets: pods
    and nodes at advertise on the apiserver's own port (a relay into the lab's network, the
    `kubernetes` Service's endpoint), the apiserver to kubelets through an HTTP CONNECT proxy
    on a unix socket that dials from inside the lab's network (deploy/lab/gateway.py)."""

    advertise: str
    egress_socket: Path


def _egress_config(socket_path: Path) -> str:
    return json.dumps(
        {
            "apiVersion": "apiserver.k8s.io/v1beta1",
            "kind": "EgressSelectorConfiguration",
            "egressSelections": [
                {
                    "name": "cluster",
                    "connection": {
                        "proxyProtocol": "HTTPConnect",
                        "transport": {"uds": {"udsName": str(socket_path)}},
                    },
                }
            ],
        }
    )


def _cluster_args(state_dir: Path, reach: Reach) -> list[str]:
    pki = state_dir / "pki"
    (state_dir / "egress.yaml").write_text(_egress_config(reach.egress_socket))
    return [
        f"--advertise-address={reach.advertise}",
        "--endpoint-reconciler-type=lease",
        "--enable-admission-plugins=NodeRestriction",
        f"--egress-selector-config-file={state_dir / 'egress.yaml'}",
        "--kubelet-preferred-address-types=InternalIP",
        f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'kubelet-client.key'}",
    ]


def _apiserver_args(
    pki: Path, port: int, etcd_port: int, service_cidrs: Sequence[str], node_port_range: str
) -> list[str]:
    """The apiserver alone, for tests that play the nodes themselves."""
    return [
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        # accepted whatever the family of the primary Service range (measured)
        "--advertise-address=127.0.0.1",
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        f"--service-cluster-ip-range={','.join(service_cidrs)}",
        f"--service-node-port-range={node_port_range}",
        # Node: kubelets of a cluster of real nodes are authorized as their own node
        "--authorization-mode=Node,RBAC",
        # as kubeadm (and so kind) sets it: node agents such as knit's DaemonSet are privileged
        "--allow-privileged=true",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        # no Endpoints for the `kubernetes` Service: they would point at a host address
        "--endpoint-reconciler-type=none",
        "--profiling=false",
    ]


def start(
    state_dir: Path,
    *,
    bin_dir: Path = CONTROLPLANE_BIN,
    service_cidrs: Sequence[str] = SERVICE_CIDRS,
    node_port_range: str = NODE_PORT_RANGE,
    detach: bool = False,
    timeout: float = 90.0,
    reach: Reach | None = None,
) -> ControlPlane:
    """Start etcd and kube-apiserver with their state in state_dir; return once /readyz is ok
    and the `kubernetes` Service exists. With reach, the apiserver serves a cluster of real
    nodes (see Reach).

    Unless detach, the kernel kills both when the thread that started them ends, so a test
    run that dies without calling stop() leaves nothing behind.
    """
    for name in PROCESSES:
        if not os.access(bin_dir / name, os.X_OK):
            raise ControlPlaneError(f"{bin_dir / name} is missing: build it with `make go-tools`")
    state_dir.mkdir(parents=True, exist_ok=True)
    pki = state_dir / "pki"
    make_pki(pki, service_cidrs, [reach.advertise] if reach else [])
    plane = ControlPlane(state_dir, _free_port(), _free_port(), [])
    try:
        began = time.monotonic()
        args = _etcd_args(state_dir, plane.etcd_port, _free_port())
        etcd = _launch(state_dir, bin_dir, "etcd", args, detach)
        plane.processes.append(etcd)
        check = http.client.HTTPConnection("127.0.0.1", plane.etcd_port, timeout=2)
        _wait_ready(etcd, state_dir / "etcd.log", check, "/health", began + timeout)
        plane.etcd_seconds = time.monotonic() - began

        began = time.monotonic()
        args = _apiserver_args(pki, plane.port, plane.etcd_port, service_cidrs, node_port_range)
        args += _cluster_args(state_dir, reach) if reach else []
        apiserver = _launch(state_dir, bin_dir, "kube-apiserver", args, detach)
        plane.processes.append(apiserver)
        check = _apiserver_check(pki, plane.port)
        log = state_dir / "kube-apiserver.log"
        _wait_ready(apiserver, log, check, "/readyz", began + timeout)
        # the `kubernetes` Service is made by a controller that waits for /readyz itself
        _wait_ready(apiserver, log, check, KUBERNETES_SERVICE, began + timeout)
        plane.apiserver_seconds = time.monotonic() - began
    except BaseException:
        plane.stop()
        raise
    plane.write_kubeconfig(plane.kubeconfig)
    return plane


def start_controllers(
    plane: ControlPlane,
    cluster_cidrs: Sequence[str],
    *,
    bin_dir: Path = CONTROLPLANE_BIN,
    service_cidrs: Sequence[str] = SERVICE_CIDRS,
    node_masks: tuple[int, int] = (24, 64),
    detach: bool = False,
    timeout: float = 90.0,
) -> None:
    """kube-controller-manager (every default controller, node CIDRs allocated from
    cluster_cidrs) and kube-scheduler, on host loopback; return once both answer /healthz."""
    state_dir, pki = plane.state_dir, plane.state_dir / "pki"
    configs = {
        name: write_kubeconfig(
            state_dir / f"{name}.kubeconfig",
            kubeconfig_for(pki, plane.server, name.removeprefix("kube-")),
        )
        for name in CONTROLLERS
    }
    ports = {name: _free_port() for name in CONTROLLERS}
    common = ["--leader-elect=false", "--bind-address=127.0.0.1", "--profiling=false"]
    args = {
        "kube-controller-manager": [
            "--allocate-node-cidrs=true",
            f"--cluster-cidr={','.join(cluster_cidrs)}",
            f"--node-cidr-mask-size-ipv4={node_masks[0]}",
            f"--node-cidr-mask-size-ipv6={node_masks[1]}",
            f"--service-cluster-ip-range={','.join(service_cidrs)}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
        ],
        "kube-scheduler": [],
    }
    deadline = time.monotonic() + timeout
    for name in CONTROLLERS:
        proc = _launch(
            state_dir,
            bin_dir,
            name,
            [
                f"--kubeconfig={configs[name]}",
                f"--authentication-kubeconfig={configs[name]}",
                f"--authorization-kubeconfig={configs[name]}",
                f"--secure-port={ports[name]}",
                *common,
                *args[name],
            ],
            detach,
        )
        plane.processes.append(proc)
        insecure = ssl.create_default_context()
        insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
        check = http.client.HTTPSConnection("127.0.0.1", ports[name], timeout=2, context=insecure)
        _wait_ready(proc, state_dir / f"{name}.log", check, "/healthz", deadline)


def restart_apiserver(state_dir: Path, timeout: float = 90.0) -> float:
    """kube-apiserver, as `start(state_dir, detach=True)` left it running, stopped and started
    again with the same command line and port, as a node's service manager restarts it;
    returns the seconds from the stop to /readyz answering."""
    name = "kube-apiserver"
    pid = int((state_dir / f"{name}.pid").read_text())
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    port = next(int(a.split("=", 1)[1]) for a in argv if a.startswith("--secure-port="))
    began = time.monotonic()
    _stop_pid(pid, name)
    apiserver = _launch(state_dir, Path(argv[0]).parent, name, argv[1:], detach=True)
    check = _apiserver_check(state_dir / "pki", port)
    _wait_ready(apiserver, state_dir / f"{name}.log", check, "/readyz", began + timeout)
    return time.monotonic() - began


def down(state_dir: Path) -> None:
    """Stop what `start(state_dir, detach=True)` (and start_controllers) left running and
    remove its state."""
    for name in reversed(PROCESSES + CONTROLLERS):
        pid_file = state_dir / f"{name}.pid"
        if pid_file.exists():
            _stop_pid(int(pid_file.read_text()), name)
    for entry in STATE:
        path = state_dir / entry
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    if state_dir.is_dir() and not any(state_dir.iterdir()):
        state_dir.rmdir()


# ---------------------------------------------------------------- CLI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    actions = parser.add_subparsers(dest="action", required=True)
    for action in ("up", "down"):
        sub = actions.add_parser(action)
        sub.add_argument("--dir", type=Path, required=True, help="state dir (certs, data, logs)")
        sub.add_argument("--bin-dir", type=Path, default=CONTROLPLANE_BIN)
        sub.add_argument("--service-cidrs", default=",".join(SERVICE_CIDRS))
    options = parser.parse_args()
    state_dir = options.dir.resolve()
    down(state_dir)
    if options.action == "down":
        return
    try:
        plane = start(
            state_dir,
            bin_dir=options.bin_dir,
            service_cidrs=options.service_cidrs.split(","),
            detach=True,
        )
    except BaseException as err:
        down(state_dir)
        if isinstance(err, ControlPlaneError):
            sys.exit(f"control plane did not start: {err}")
        raise
    print(
        f"etcd ready in {plane.etcd_seconds:.1f}s, "
        f"kube-apiserver ready in {plane.apiserver_seconds:.1f}s at {plane.server}"
    )
    print(f"export KUBECONFIG={plane.kubeconfig}")
    print(f"stop: {sys.executable} {Path(__file__)} down --dir {state_dir}")


if __name__ == "__main__":
    main()
