"""The VM node's boot files, built once and cached under build/vm/: Debian's kernel (the
version `linux-image-amd64` depends on, unpacked from its package) and an initramfs that is
the whole root filesystem.

The root filesystem is the lab images' Debian base (deploy/lab/image/steps.py, shared with
their cache) with the tools the tests need, knit's Python dependencies (pip, pinned by
pyproject.toml), the kernel's network, crypto and virtio modules, and `/init`
(deploy/lab/vm_init.sh). It holds no knit code: the VM mounts the checkout read-only over 9p,
so a code change needs no rebuild. Everything runs from RAM: no disk, nothing to loop-mount,
and each boot starts from the same tree.

Each output is named by a key of its inputs (package versions, pins, the init script, this
module's RECIPE), so a change of any of them builds anew and removes the old one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deploy.lab.image.cache import locked, remove_tree
from deploy.lab.image.steps import base_step, chroot, packages_step, run
from deploy.lab.paths import BUILD, ROOT
from deploy.lab.vm_cpio import write_cpio

VM_BUILD = BUILD / "vm"
INIT = Path(__file__).resolve().parent / "vm_init.sh"
# Bump when the assembly below changes in a way the other inputs do not show.
RECIPE = 2
PACKAGES = (
    "iproute2", "nftables", "libnftables1", "iptables", "ipset", "conntrack", "ipvsadm",
    "kmod", "procps", "python3", "openssl",
)  # fmt: skip
# Under lib/modules/VERSION/kernel: what networking and the VM's virtio devices load.
MODULE_DIRS = (
    "net", "lib", "crypto", "arch", "fs/9p", "fs/netfs", "fs/fscache", "drivers/virtio",
    "drivers/net/vxlan", "drivers/net/virtio_net.ko", "drivers/net/net_failover.ko",
    "drivers/net/dummy.ko", "drivers/net/veth.ko",
)  # fmt: skip
PYCACHE = "/opt/knit/pycache"
"""The VM's PYTHONPYCACHEPREFIX (vm_init.sh names it too)."""
TEST_PINS = ("pytest==", "pytest-timeout==", "hypothesis==")
"""The test extras the VM needs to run test modules (not the linters)."""
# Left out of the initramfs, whose size is most of the boot time (the kernel unpacks it under
# TCG): documentation, and the kubernetes client's asyncio copy (68 MB), which knit never loads.
TRIMMED = (
    "usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "var/cache",
    "opt/knit/site/kubernetes/aio",
)  # fmt: skip


@dataclass(frozen=True)
class BootFiles:
    kernel: Path
    initrd: Path
    version: str
    """The kernel's release (uname -r)."""


def kernel_package() -> str:
    """The linux-image package linux-image-amd64 depends on now."""
    out = run(["apt-cache", "depends", "linux-image-amd64"])
    for line in out.splitlines():
        name = line.strip().removeprefix("Depends: ")
        if name.startswith("linux-image-") and name[len("linux-image-")].isdigit():
            return name
    raise RuntimeError(f"linux-image-amd64 names no kernel package:\n{out}")


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps([RECIPE, *parts]).encode()).hexdigest()[:16]


def _replace_other_keys(kept: Path) -> None:
    for other in kept.parent.glob(f"{kept.name.rpartition('-')[0]}-*"):
        if other != kept:
            if other.is_dir():
                remove_tree(other)
            else:
                other.unlink()


def kernel_tree(package: str) -> Path:
    """build/vm/kernel-KEY: the package unpacked (boot/vmlinuz-*, lib/modules/*)."""
    tree = VM_BUILD / f"kernel-{_digest(package, run(['apt-cache', 'show', package]))}"
    if tree.is_dir():
        return tree
    with tempfile.TemporaryDirectory(dir=VM_BUILD) as work:
        # as root, as the rest of the build: apt would fall back to it (and warn) anyway, its
        # _apt user cannot write the temporary folder
        download = ["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", package]
        subprocess.run(download, cwd=work, check=True)
        (deb,) = Path(work).glob("*.deb")
        run(["dpkg-deb", "-x", deb, Path(work) / "tree"])
        (Path(work) / "tree").rename(tree)
    _replace_other_keys(tree)
    return tree


def python_dependencies() -> list[str]:
    """knit's runtime requirements and the test runner's, as pyproject.toml pins them (the
    VM runs test modules itself; the linters stay on the host)."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    runner = [pin for pin in project["optional-dependencies"]["test"] if pin.startswith(TEST_PINS)]
    return [*project["dependencies"], *runner]


def _compile(rootfs: Path) -> None:
    """Python's bytecode under PYCACHE, where the VM's Python reads and writes it: knit's code
    comes from a read-only share, so /init sets PYTHONPYCACHEPREFIX, and with a prefix Python
    ignores the __pycache__ folders beside the sources. Compiled here once, the standard
    library and the dependencies are not compiled again under TCG at every boot; the folders
    it no longer reads go."""
    for cache in sorted(rootfs.glob("**/__pycache__"), reverse=True):
        remove_tree(cache)
    # A file that does not compile (test data of some package) only stays uncompiled: do not
    # fail the build on compileall's exit code.
    compile_all = "python3 -m compileall -q /usr/lib/python3 /usr/lib/python3.11 /opt/knit/site"
    chroot(rootfs, "sh", "-c", f"{compile_all} || true", env={"PYTHONPYCACHEPREFIX": PYCACHE})


def _assemble(rootfs: Path, kernel: Path, version: str) -> None:
    """The packages' tree becomes the VM's: pip packages, modules, /init, no docs."""
    # The host's pip for this same Debian's Python (3.11): its wheels fit the VM's.
    site = rootfs / "opt/knit/site"
    pip: list[str | Path] = [sys.executable, "-m", "pip", "install", "-q", "--target", site]
    run([*pip, *python_dependencies()])
    source = kernel / "lib/modules" / version
    target = rootfs / "lib/modules" / version
    target.mkdir(parents=True)
    for name in ("modules.order", "modules.builtin", "modules.builtin.modinfo"):
        shutil.copy2(source / name, target / name)
    for part in MODULE_DIRS:
        destination = target / "kernel" / part
        destination.parent.mkdir(parents=True, exist_ok=True)
        copy = shutil.copytree if (source / "kernel" / part).is_dir() else shutil.copy2
        copy(source / "kernel" / part, destination)
    chroot(rootfs, "depmod", version)
    for trimmed in TRIMMED:
        remove_tree(rootfs / trimmed)
    _compile(rootfs)
    shutil.copy2(INIT, rootfs / "init")
    (rootfs / "init").chmod(0o755)


def build(log: Callable[[str], None] = print) -> BootFiles:
    """The kernel and initramfs, built unless build/vm/ has them for the same inputs."""
    VM_BUILD.mkdir(parents=True, exist_ok=True)
    package = kernel_package()
    kernel = kernel_tree(package)
    (vmlinuz,) = (kernel / "boot").glob("vmlinuz-*")
    version = vmlinuz.name.removeprefix("vmlinuz-")
    with locked():
        packages = packages_step("vm-packages", base_step(log), PACKAGES, log)
    inputs = (kernel.name, packages.key, python_dependencies(), INIT.read_text())
    initrd = VM_BUILD / f"initrd-{_digest(*inputs, MODULE_DIRS, TRIMMED)}.cpio"
    if not initrd.exists():
        began = time.monotonic()
        log(f"vm: building {initrd.name} (kernel {version})")
        with tempfile.TemporaryDirectory(dir=VM_BUILD) as work:
            rootfs = Path(work) / "rootfs"
            run(["cp", "-a", "--reflink=auto", packages.rootfs(), rootfs])
            _assemble(rootfs, kernel, version)
            write_cpio(rootfs, Path(work) / "initrd.cpio")
            (Path(work) / "initrd.cpio").rename(initrd)
        _replace_other_keys(initrd)
        log(f"vm: {initrd.name} built in {time.monotonic() - began:.0f}s")
    return BootFiles(vmlinuz, initrd, version)


def main() -> None:
    files = build()
    print(json.dumps({"kernel": str(files.kernel), "initrd": str(files.initrd)}))


if __name__ == "__main__":
    main()
