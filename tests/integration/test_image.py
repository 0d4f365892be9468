"""deploy.lab.image: the lab's images built without Docker, as containerd imports them.

The module's fixture builds all three images (as root: debootstrap and chroot). A cold build
fetches Debian packages and PyPI wheels (~2 minutes); the cache under build/images/cache/ makes
the next one take seconds. pause and agnhost use build/images/{pause,agnhost} when they exist,
else a static reference CNI plugin stands in for the binary.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.lab import image

TOOLS = ("debootstrap", "unshare", "chroot", "containerd", "ctr")
PAUSE = image.PAUSE_BINARY
AGNHOST = image.AGNHOST_BINARY


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    assert not missing, f"{missing} missing: apt-get install debootstrap containerd"
    for binary in (image.PORTMAP, PAUSE, AGNHOST):
        assert binary.is_file(), f"{binary} is missing (make go-tools)"
    assert image.CLIENT.is_file(), f"{image.CLIENT} is missing (make cni)"
    return image.build(tmp_path_factory.mktemp("images"), PAUSE, AGNHOST, log=lambda _: None)


@pytest.fixture(scope="module")
def dockerfile() -> image.Dockerfile:
    return image.read_dockerfile()


class Archive:
    """An OCI image archive: its one image's config and layers, and the merged files."""

    def __init__(self, path: Path) -> None:
        self.tar = tarfile.open(path)  # noqa: SIM115 (closed by the fixture)
        index = self.json("index.json")
        (self.descriptor,) = index["manifests"]
        self.manifest = self.json(self.blob_name(self.descriptor["digest"]))
        self.config = self.json(self.blob_name(self.manifest["config"]["digest"]))
        self.layer_digests = [layer["digest"] for layer in self.manifest["layers"]]

    @staticmethod
    def blob_name(digest: str) -> str:
        return "blobs/" + digest.replace(":", "/")

    def json(self, name: str) -> Any:
        f = self.tar.extractfile(name)
        assert f is not None, name
        return json.loads(f.read())

    def layers(self) -> Iterator[tarfile.TarFile]:
        for digest in self.layer_digests:
            f = self.tar.extractfile(self.blob_name(digest))
            assert f is not None
            assert "sha256:" + hashlib.file_digest(f, "sha256").hexdigest() == digest
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r:gz") as layer:
                yield layer

    def files(self) -> dict[str, tuple[tarfile.TarInfo, bytes | None]]:
        """path -> (entry, contents of the small regular files) of the layers applied in
        order, whiteouts honoured."""
        merged: dict[str, tuple[tarfile.TarInfo, bytes | None]] = {}
        for layer in self.layers():
            for member in layer:
                name = member.name.rstrip("/")
                parent, _, base = name.rpartition("/")
                if base.startswith(".wh."):
                    gone = f"{parent}/{base[4:]}" if parent else base[4:]
                    merged = {
                        k: v
                        for k, v in merged.items()
                        if k != gone and not k.startswith(gone + "/")
                    }
                    continue
                data = None
                if member.isreg() and member.size < 4 << 20:
                    f = layer.extractfile(member)
                    data = f.read() if f else None
                merged[name] = (member, data)
        return merged


@pytest.fixture(scope="module")
def opened(archives: dict[str, Path]) -> Iterator[dict[str, Archive]]:
    found = {name: Archive(path) for name, path in archives.items()}
    yield found
    for archive in found.values():
        archive.tar.close()


def installed_packages(files: dict[str, tuple[tarfile.TarInfo, bytes | None]]) -> set[str]:
    status = files["var/lib/dpkg/status"][1]
    assert status is not None
    packages = set()
    for paragraph in status.decode().split("\n\n"):
        lines = [line for line in paragraph.splitlines() if ": " in line and line[0] != " "]
        fields = dict(line.split(": ", 1) for line in lines)
        if fields.get("Status") == "install ok installed":
            packages.add(fields["Package"])
    return packages


def test_the_archives_name_the_images(archives):
    assert set(archives) == {
        image.KNIT_IMAGE,
        image.PAUSE_IMAGE,
        image.AGNHOST_IMAGE,
        image.GLIBC_DNS_TESTING_IMAGE,
    }
    for name, path in archives.items():
        assert image.image_names(path) == [name]
        with tarfile.open(path) as tar:
            names = tar.getnames()
        assert names[:2] == ["oci-layout", "index.json"]
        assert all(
            n in ("blobs", "blobs/sha256") or n.startswith("blobs/sha256/") for n in names[2:]
        )


def test_the_knit_image_config_is_the_dockerfiles(opened, dockerfile):
    final = dockerfile.final
    config = opened[image.KNIT_IMAGE].config
    assert config["os"] == "linux"
    assert config["config"]["Entrypoint"] == final.entrypoint() == ["knit-proxyd"]
    env = dict(entry.split("=", 1) for entry in config["config"]["Env"])
    assert env == final.env(image.BASE_ENV)
    assert env["PATH"].startswith("/opt/knit/venv/bin:")
    assert env["PYTHONUNBUFFERED"] == "1"
    assert config["config"]["User"] == final.user() == "root"
    assert "Cmd" not in config["config"]


def test_the_knit_image_holds_the_packages_venv_and_bundle(opened, dockerfile):
    files = opened[image.KNIT_IMAGE].files()
    packages = installed_packages(files)
    wanted = {*image.KNIT_BASE_PACKAGES, *dockerfile.final.apt_packages()}
    assert {"iptables", "nftables", "kmod"} <= wanted <= packages
    proxyd, _ = files["opt/knit/venv/bin/knit-proxyd"]
    assert proxyd.isreg() and proxyd.mode & 0o111
    assert files["opt/knit/venv/bin/python3"][0].linkname == "/usr/bin/python3"
    manifest = json.loads(files["opt/knit/cni-bundle/manifest.json"][1] or b"")
    portmap_digest = hashlib.sha256(image.PORTMAP.read_bytes()).hexdigest()
    assert manifest["plugins"] == {"portmap": portmap_digest}
    assert files[f"opt/knit/cni-bundle/{manifest['interpreter']}"][0].isreg()
    client, _ = files[f"opt/knit/cni-bundle/{manifest['client']}"]
    assert client.isreg() and client.size == image.CLIENT.stat().st_size and client.mode & 0o111
    assert "gcc" not in packages
    assert not any(path.startswith(("tmp/knit-build", "root/.cache")) for path in files)


def unpack(layers: Iterator[tarfile.TarFile], root: Path) -> None:
    """Apply the layers as containerd does: whiteouts remove, an entry replaces what was there
    unless both are directories. Never through a symlink: a parent must be a real directory
    (the builder's layers are walks of real directories) and the target is removed first."""
    for layer in layers:
        for member in layer:
            parts = member.name.rstrip("/").split("/")
            assert ".." not in parts and parts[0], member.name
            for depth in range(1, len(parts)):
                parent = root.joinpath(*parts[:depth])
                assert not parent.is_symlink(), f"{member.name} goes through a symlink"
            target = root.joinpath(*parts)
            if parts[-1].startswith(".wh."):
                target = target.with_name(parts[-1][4:])
            if target.is_symlink() or (
                target.exists() and not (target.is_dir() and member.isdir())
            ):
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                else:
                    target.unlink()
            if not parts[-1].startswith(".wh."):
                layer.extract(member, root, filter="fully_trusted")


def test_knit_proxyd_runs_in_the_image_rootfs(opened, tmp_path):
    """The layers unpacked, the entrypoint run with the image's environment (chroot)."""
    archive = opened[image.KNIT_IMAGE]
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    unpack(archive.layers(), rootfs)
    env = dict(entry.split("=", 1) for entry in archive.config["config"]["Env"])
    try:
        out = image.chroot(rootfs, *archive.config["config"]["Entrypoint"], "--help", env=env)
        assert "usage: knit-proxyd" in out
        image.chroot(rootfs, "modprobe", "--version")
        image.chroot(rootfs, "nft", "--version")
        assert "nf_tables" in image.chroot(rootfs, "iptables", "--version")
    finally:
        assert not image.mounts_under(rootfs)


def test_no_device_nodes_and_a_shared_base_layer(opened):
    for archive in opened.values():
        for layer in archive.layers():
            for member in layer:
                assert not (member.ischr() or member.isblk() or member.isfifo()), member.name
    knit, agnhost = opened[image.KNIT_IMAGE], opened[image.AGNHOST_IMAGE]
    assert knit.layer_digests[0] == agnhost.layer_digests[0]


def test_the_pause_image_is_the_binary_alone(opened):
    pause = opened[image.PAUSE_IMAGE]
    assert pause.config["config"]["Entrypoint"] == ["/pause"]
    assert len(pause.layer_digests) == 1
    for layer in pause.layers():
        (member,) = layer.getmembers()
        assert (member.name, member.mode, member.uid) == ("pause", 0o755, 0)
        f = layer.extractfile(member)
        assert f is not None and f.read() == PAUSE.read_bytes()


def test_the_agnhost_image_has_the_tools_and_the_binary(opened):
    agnhost = opened[image.AGNHOST_IMAGE]
    assert agnhost.config["config"]["Entrypoint"] == ["/agnhost"]
    files = agnhost.files()
    assert set(image.AGNHOST_PACKAGES) <= installed_packages(files)
    for tool in ("curl", "wget", "nc", "dig", "nslookup", "ip", "ping", "ps"):
        assert f"usr/bin/{tool}" in files or f"bin/{tool}" in files, tool
    for tool in ("iptables", "conntrack"):
        assert f"usr/sbin/{tool}" in files or f"sbin/{tool}" in files, tool
    assert files["agnhost"][0].size == AGNHOST.stat().st_size
    assert files["usr/local/bin/agnhost"][0].linkname == "/agnhost"
    for name in ("localhost.crt", "localhost.key"):
        assert files[name][1] == (AGNHOST.parent / name).read_bytes()


def test_the_e2e_images_hold_what_the_specs_run(tmp_path):
    assert image.REGRESSION_74839_BINARY.is_file(), "make e2e-tools builds it"
    archives = image.build_e2e_images(tmp_path, log=lambda _: None)
    opened = {name: Archive(path) for name, path in archives.items()}
    try:
        nginx = opened[image.NGINX_IMAGE]
        assert nginx.config["config"]["Cmd"] == ["nginx", "-g", "daemon off;"]
        assert "usr/sbin/nginx" in nginx.files()
        for name in (image.BUSYBOX_IMAGE, image.DISTROLESS_IPTABLES_IMAGE):
            files = opened[name].files()
            for tool in ("bin/sh", "bin/nc", "bin/sleep", "sbin/iptables", "sbin/conntrack"):
                assert tool in files or f"usr/{tool}" in files, (name, tool)
        regression = opened[image.REGRESSION_74839_IMAGE]
        assert regression.config["config"]["Entrypoint"] == ["/regression-issue-74839"]
        (binary,) = regression.files().values()
        assert binary[0].size == image.REGRESSION_74839_BINARY.stat().st_size
    finally:
        for archive in opened.values():
            archive.tar.close()


def test_a_rebuild_of_unchanged_inputs_leaves_the_archives(archives):
    output = next(iter(archives.values())).parent
    before = {path: path.stat().st_mtime_ns for path in archives.values()}
    again = image.build(output, PAUSE, AGNHOST, log=lambda _: None)
    assert again == archives
    assert {path: path.stat().st_mtime_ns for path in again.values()} == before


# ---------------------------------------------------------------- containerd


CONTAINERD_CONFIG = """\
version = 2
root = "{dir}/root"
state = "{dir}/state"
# the CRI plugin (not needed to import) would watch the host's /etc/cni/net.d
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{dir}/containerd.sock"
[ttrpc]
  address = "{dir}/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{dir}/opt"
"""


@contextlib.contextmanager
def throwaway_containerd() -> Iterator[list[str]]:
    """containerd with its own root, state and socket in a temporary folder (short: a socket
    path has ~108 bytes), in a private mount namespace so its snapshot mounts go with it;
    yields the ctr command for the k8s.io namespace, stops it and removes the folder."""
    directory = Path(tempfile.mkdtemp(prefix="knit-containerd-"))
    (directory / "config.toml").write_text(CONTAINERD_CONFIG.format(dir=directory))
    ctr = ["ctr", "--address", str(directory / "containerd.sock"), "-n", "k8s.io"]
    with (directory / "containerd.log").open("w") as log:
        daemon = subprocess.Popen(
            [
                *("unshare", "--mount", "--propagation", "private"),
                *("containerd", "--config", str(directory / "config.toml")),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while subprocess.run([*ctr, "version"], capture_output=True).returncode != 0:
            assert daemon.poll() is None, (directory / "containerd.log").read_text()
            assert time.monotonic() < deadline, "containerd did not start"
            time.sleep(0.2)
        yield ctr
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        assert not image.mounts_under(directory)
        shutil.rmtree(directory)


def test_containerd_imports_the_archives(archives):
    with throwaway_containerd() as ctr:
        names = image.import_images(ctr, archives.values())
        assert sorted(names) == sorted(archives)
        listed = subprocess.run(
            [*ctr, "images", "ls", "-q"], capture_output=True, text=True, check=True
        ).stdout.split()
        assert sorted(listed) == sorted(archives)
        check = subprocess.run(
            [*ctr, "images", "check"], capture_output=True, text=True, check=True
        ).stdout
        for name in archives:
            (line,) = [line for line in check.splitlines() if line.startswith(name + " ")]
            assert "complete" in line and line.split()[-1] == "true", line  # unpacked too
