"""The plugin installed from its self-contained bundle (cni.bundle, cni.install): it runs with
no Python of the host's reachable, through libcni; upgrades keep running pods and running calls
working; the client, its launch file and the plugins are replaced by rename only."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cni.bundle import GLIBC, MANIFEST, PLUGINS, read_manifest, seal
from cni.install import LAUNCH, LAUNCHER, TEMP_PREFIX, VERSIONS, InstallError, install
from deploy.lab.netns import Netns
from deploy.lab.paths import CNIDRIVER, PLUGIN_DIR, REFERENCE_PLUGINS, ROOT
from tests.support.cni_env import NETWORK, Node, bridge_conf

SYSTEM_PYTHON = Path("/usr/bin/python3")
CONTAINERD_ARGS = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}"

# Run by a bundled interpreter: where it found itself, its modules and its shared libraries.
DEBUG = r"""
import json, shutil, sys
sys.path.append(sys.argv[1])
import cni.bridge, cni.ipam.hostlocal, cni.masq, cni.plugin
print(json.dumps({
    "prefix": sys.prefix,
    "path": sys.path,
    "modules": sorted(m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", 0)),
    "libraries": sorted({l.split()[-1] for l in open("/proc/self/maps") if ".so" in l}),
    "python_on_path": shutil.which("python3") or shutil.which("python"),
}))
"""


def build_bundle(python: Path, output: Path) -> Path:
    """`python -m cni.bundle` as the image build runs it, with the client `make cni` builds and
    the reference portmap."""
    site = subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    executables = ["--client", PLUGIN_DIR / "knit", "--plugin", REFERENCE_PLUGINS / "portmap"]
    built = subprocess.run(
        [python, "-m", "cni.bundle", "--output", output, *executables],
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{site}"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    return output


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The bundle built from this venv's interpreter (here pyenv's, which links libpython
    dynamically) and, when the machine has a recent enough one, from /usr/bin/python3 (Debian's
    links it statically)."""
    if not (REFERENCE_PLUGINS / "portmap").exists() or not CNIDRIVER.exists():
        pytest.fail("build/refcni/portmap or build/tools/cnidriver is missing: run `make go-tools`")
    tmp = tmp_path_factory.mktemp("bundles")
    built = {"venv": build_bundle(Path(sys.executable), tmp / "venv")}
    if (
        subprocess.run(
            [SYSTEM_PYTHON, "-c", "import sys; sys.exit(sys.version_info < (3, 11))"], check=False
        ).returncode
        == 0
    ):
        built["system"] = build_bundle(SYSTEM_PYTHON, tmp / "system")
    return built


@pytest.fixture(scope="module")
def variant(
    bundles: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """A copy of the venv bundle with one change, resealed: another content hash."""
    tmp = tmp_path_factory.mktemp("variants")

    def make(name: str, change: Callable[[Path], None] | None = None) -> Path:
        tree = tmp / name
        if not tree.exists():
            shutil.copytree(bundles["venv"], tree)
            (tree / "site" / f"marker-{name}").write_text(name)
            if change is not None:
                change(tree)
            seal(tree)
        return tree

    return make


def hidden_run(
    ns: Netns, argv: list[str | Path], env: dict[str, str], stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run argv in the namespace with no Python of the host's usable: a fresh mount namespace
    with empty tmpfs over the source tree (and its venv), the interpreter this venv comes from
    and every system Python's library, and a PATH without any directory holding a python."""
    hidden: list[Path] = []
    candidates = [ROOT, Path(sys.prefix), Path(sys.base_prefix).resolve()]
    candidates += [*Path("/usr/lib").glob("python3*"), *Path("/usr/local/lib").glob("python3*")]
    for path in sorted(set(candidates), key=lambda p: len(p.parts)):
        if path.is_dir() and not any(path.is_relative_to(h) for h in hidden):
            hidden.append(path)
    mounts = "".join(f"mount -t tmpfs -o ro knit-hide {shlex.quote(str(p))} && " for p in hidden)
    assignments = " ".join(
        shlex.quote(f"{k}={v}") for k, v in {"PATH": python_free_path(), **env}.items()
    )
    script = f'{mounts}exec /usr/bin/env -i {assignments} "$@"'
    argv_text = [str(a) for a in argv]
    return ns.run(
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "/bin/sh",
        "-c",
        script,
        "sh",
        *argv_text,
        stdin=stdin,
        check=False,
    )


def python_free_path() -> str:
    entries = [p for p in os.environ["PATH"].split(":") if p and not any(Path(p).glob("python*"))]
    path = ":".join(dict.fromkeys(entries))
    assert shutil.which("iptables", path=path), f"no iptables left on {path}"
    return path


@dataclass
class Runtime:
    """libcni (cnidriver) driving a conflist of knit + portmap found only in bin_dir."""

    node: Node
    bin_dir: Path
    work: Path

    def __post_init__(self) -> None:
        self.work.mkdir()
        self.driver = self.work / "cnidriver"
        shutil.copy2(CNIDRIVER, self.driver)
        plugin = {
            k: v
            for k, v in bridge_conf(self.node.data_dir, ipMasq=True, macspoofchk=True).items()
            if k not in ("cniVersion", "name")
        }
        self.conflist = self.work / "10-knit.conflist"
        self.conflist.write_text(
            json.dumps(
                {
                    "cniVersion": "1.1.0",
                    "name": NETWORK,
                    "plugins": [
                        plugin,
                        {"type": "portmap", "capabilities": {"portMappings": True}},
                    ],
                }
            )
        )

    def argv(self, verb: str, pod: Netns | None = None, name: str = "") -> list[str | Path]:
        argv: list[str | Path] = [self.driver, verb, "--conflist", self.conflist]
        argv += ["--cni-path", self.bin_dir, "--cache-dir", self.work / "cache"]
        if pod is not None:
            argv += ["--netns", pod.path, "--container-id", name, "--ifname", "eth0"]
            argv += ["--args", CONTAINERD_ARGS.format(name=name)]
        return argv

    def __call__(self, verb: str, pod: Netns | None = None, name: str = "") -> Any:
        result = self.node.ns.run(*map(str, self.argv(verb, pod, name)), check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        return json.loads(result.stdout) if result.stdout.strip() else None


def plugin_env(command: str, container_id: str = "", netns: str = "") -> dict[str, str]:
    return {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container_id,
        "CNI_NETNS": netns,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "",
    }


def files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root: (inode, mtime)."""
    return {
        str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def leftover_temporaries(bin_dir: Path) -> list[str]:
    return [
        p.name
        for p in [*bin_dir.iterdir(), *(bin_dir / VERSIONS).iterdir()]
        if p.name.startswith(TEMP_PREFIX)
    ]


@pytest.mark.parametrize("flavour", ["venv", "system"])
def test_the_installed_plugin_needs_no_python_of_the_host(
    flavour, bundles, node, make_netns, tmp_path
):
    if flavour not in bundles:
        pytest.skip(f"no Python 3.11+ at {SYSTEM_PYTHON} on this machine")
    manifest = read_manifest(bundles[flavour])
    bin_dir = tmp_path / "opt-cni-bin"
    version_dir = install(bundles[flavour], bin_dir, None)
    assert version_dir == bin_dir / VERSIONS / manifest["version"]

    # The host's Pythons are unusable in there (so the hiding works) ...
    for python in (sys.executable, SYSTEM_PYTHON):
        assert hidden_run(node.ns, [python, "-c", "import os"], {}).returncode != 0
    # ... and the bundled interpreter finds everything inside the installed version.
    interpreter = version_dir / manifest["interpreter"]
    debug = hidden_run(
        node.ns,
        [interpreter, "-I", "-S", "-c", DEBUG, version_dir / "site"],
        {"LD_LIBRARY_PATH": str(version_dir / "lib")},
    )
    assert debug.returncode == 0, debug.stderr
    seen = json.loads(debug.stdout)
    inside = str(version_dir) + "/"
    assert seen["prefix"] == str(version_dir)
    assert seen["python_on_path"] is None
    assert all(entry.startswith(inside) for entry in seen["path"]), seen["path"]
    assert all(module.startswith(inside) for module in seen["modules"]), seen["modules"]
    foreign = [lib for lib in seen["libraries"] if not lib.startswith(inside)]
    assert all(GLIBC.match(Path(lib).name) for lib in foreign), foreign
    shipped = sorted(str(lib) for lib in (version_dir / "lib").glob("libpython*"))
    assert [lib for lib in seen["libraries"] if "/libpython" in lib] == shipped

    # VERSION as a runtime calls it, then ADD, CHECK, STATUS and DEL through libcni with
    # CNI_PATH = the bin dir alone (knit and the bundle's portmap).
    version = hidden_run(node.ns, [bin_dir / LAUNCHER], plugin_env("VERSION"), stdin="")
    assert version.returncode == 0, version.stderr
    assert "1.1.0" in json.loads(version.stdout)["supportedVersions"]
    runtime = Runtime(node, bin_dir, tmp_path / "runtime")
    pod = make_netns("pod")
    for verb in ("add", "check", "status", "del"):
        result = hidden_run(node.ns, runtime.argv(verb, pod, "web"), {})
        assert result.returncode == 0, result.stdout + result.stderr
        if verb == "add":
            assert json.loads(result.stdout)["ips"][0]["address"] == "10.244.1.2/24"
            assert node.reservations() == ["10.244.1.2"]
    assert node.leftovers() == {}


def started_on(proc: subprocess.Popen[bytes], interpreter: Path) -> None:
    """Wait until the launcher has exec'd the given interpreter."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if Path(os.readlink(f"/proc/{proc.pid}/exe")) == interpreter:
                return
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    raise AssertionError(f"the call did not start on {interpreter}")


def test_upgrade_under_running_pods(bundles, variant, node, make_netns, tmp_path):
    bin_dir = tmp_path / "bin"
    runtime = Runtime(node, bin_dir, tmp_path / "runtime")
    dir_a = install(bundles["venv"], bin_dir, None)
    web = make_netns("pod")
    assert runtime("add", web, "web")["ips"][0]["address"] == "10.244.1.2/24"

    # A call that started on A (it waits for its config on stdin) while B is installed.
    late = make_netns("pod")
    env = {**plugin_env("ADD", "late", late.path), "PATH": os.environ["PATH"]}
    call = subprocess.Popen(
        ["ip", "netns", "exec", node.ns.name, bin_dir / LAUNCHER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        started_on(call, dir_a / read_manifest(dir_a)["interpreter"])
        dir_b = install(variant("b"), bin_dir, None)
        assert dir_b != dir_a and dir_a.is_dir(), "the previous version stays"
        conf = json.dumps(bridge_conf(node.data_dir, ipMasq=True)).encode()
        out, err = call.communicate(conf, timeout=60)
    finally:
        if call.poll() is None:
            call.kill()
            call.wait()
    assert call.returncode == 0, out + err
    assert json.loads(out)["ips"][0]["address"] == "10.244.1.3/24"

    # DEL of A's pods runs on B alone: A's directory is out of the way meanwhile.
    aside = dir_a.with_name("aside")
    dir_a.rename(aside)
    try:
        runtime("del", web, "web")
        runtime("del", late, "late")
    finally:
        aside.rename(dir_a)
    assert node.leftovers() == {}, "B released the pods A created"

    dir_c = install(variant("c"), bin_dir, None)
    assert sorted(p.name for p in (bin_dir / VERSIONS).iterdir() if p.is_dir()) == sorted(
        [dir_b.name, dir_c.name]
    ), "A is pruned once it is no longer the previous version"
    install(variant("c"), bin_dir, None)
    assert [p for p in (bin_dir / VERSIONS).iterdir() if p.is_dir()] == [dir_c]
    assert leftover_temporaries(bin_dir) == []


def test_install_replaces_by_rename_and_a_repeat_changes_nothing(bundles, variant, tmp_path):
    bin_dir = tmp_path / "bin"
    launch = f"{VERSIONS}/{LAUNCH}"
    version_dir = install(bundles["venv"], bin_dir, "/run/knit/cni.sock")
    before = files(bin_dir)
    old_launch = (bin_dir / launch).open()
    install(bundles["venv"], bin_dir, "/run/knit/cni.sock")
    assert files(bin_dir) == before, "a second install of the same bundle changes nothing"
    assert (bin_dir / launch).read_text() == (
        f"plugin={VERSIONS}/{version_dir.name}/bin/knit-in-process\nsocket=/run/knit/cni.sock\n"
    )

    install(variant("b"), bin_dir, "/run/knit/cni.sock")
    after = files(bin_dir)
    assert after[launch][0] != before[launch][0], "the launch file is replaced by rename"
    assert before[launch][0] == os.fstat(old_launch.fileno()).st_ino
    assert old_launch.read() != (bin_dir / launch).read_text(), "the old one is intact"
    old_launch.close()
    assert after[LAUNCHER] == before[LAUNCHER], "the same client is left alone"
    assert after["portmap"] == before["portmap"], "an unchanged plugin is left alone"

    # Another socket rewrites only the launch file; another client or portmap replaces it.
    install(variant("b"), bin_dir, "/run/knit/other.sock")
    resocketed = files(bin_dir)
    assert {name for name in resocketed if resocketed[name] != after.get(name)} == {launch}

    def another(path: str) -> Callable[[Path], None]:
        def change(tree: Path) -> None:
            with (tree / path).open("ab") as f:
                f.write(b"\0")

        return change

    for name, path in [("portmap", f"{PLUGINS}/portmap"), (LAUNCHER, "bin/knit")]:
        install(variant(name, another(path)), bin_dir, None)
        replaced = files(bin_dir)
        assert replaced[name][0] != after[name][0]
        assert (bin_dir / name).read_bytes() == (variant(name) / path).read_bytes()
        assert os.access(bin_dir / name, os.X_OK)
    assert leftover_temporaries(bin_dir) == []


def test_install_recovers_from_an_interrupted_one_and_refuses_a_runtime_that_does_not_run(
    bundles, variant, tmp_path
):
    bin_dir = tmp_path / "bin"
    version_dir = install(bundles["venv"], bin_dir, None)
    launch = (bin_dir / VERSIONS / LAUNCH).read_text()
    # What a killed install leaves: temporary files, a half-copied version, a version
    # directory without its manifest.
    (bin_dir / f"{TEMP_PREFIX}x").write_text("half a client")
    (bin_dir / VERSIONS / f"{TEMP_PREFIX}z").write_text("half a launch file")
    (bin_dir / VERSIONS / f"{TEMP_PREFIX}y" / "lib").mkdir(parents=True)
    (version_dir / MANIFEST).unlink()
    install(bundles["venv"], bin_dir, None)
    assert read_manifest(version_dir)["version"] == version_dir.name
    assert leftover_temporaries(bin_dir) == []
    assert [p for p in (bin_dir / VERSIONS).iterdir() if p.is_dir()] == [version_dir]

    def broken_interpreter(tree: Path) -> None:
        (tree / read_manifest(tree)["interpreter"]).write_text("#!/bin/sh\nexit 3\n")

    with pytest.raises(InstallError, match="does not answer VERSION"):
        install(variant("broken", broken_interpreter), bin_dir, None)
    assert (bin_dir / VERSIONS / LAUNCH).read_text() == launch, "the working version stays"
    assert leftover_temporaries(bin_dir) == []

    # The client finds its runtime beside itself, wherever the directory is mounted.
    moved = bin_dir.rename(tmp_path / "elsewhere")
    answer = subprocess.run(
        [moved / LAUNCHER], env=plugin_env("VERSION"), input=b"", capture_output=True, check=True
    )
    assert json.loads(answer.stdout)["cniVersion"] == "1.1.0"
