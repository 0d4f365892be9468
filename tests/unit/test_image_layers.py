"""deploy.lab.image's layers and OCI archives, on small trees (no debootstrap, no root)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from deploy.lab.image import cache, layers, oci, recipes


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(layers, "XATTRS", ("user.knit-test",))
    return tmp_path / "cache"


def tree(root: Path) -> Path:
    (root / "etc" / "sub").mkdir(parents=True)
    (root / "etc" / "a.conf").write_text("a\n")
    (root / "etc" / "sub" / "b").write_text("b\n")
    (root / "gone").mkdir()
    (root / "gone" / "file").write_text("x")
    (root / "bin").mkdir()
    (root / "bin" / "tool").write_text("#!/bin/sh\n")
    (root / "bin" / "tool").chmod(0o755)
    os.link(root / "bin" / "tool", root / "bin" / "tool2")
    (root / "link").symlink_to("etc/a.conf")
    (root / "todir").write_text("a file that becomes a directory")
    os.mkfifo(root / "fifo")
    return root


def changes(upper: Path, lower: Path | None = None) -> list[str]:
    return [entry.path for entry in layers.tree_changes(upper, lower)]


def test_a_whole_tree_parents_first_sorted_and_no_special_files(tmp_path):
    root = tree(tmp_path / "root")
    assert changes(root) == [
        "bin",
        "bin/tool",
        "bin/tool2",
        "etc",
        "etc/a.conf",
        "etc/sub",
        "etc/sub/b",
        "gone",
        "gone/file",
        "link",
        "todir",
    ]


def test_the_changes_between_two_trees(tmp_path):
    lower = tree(tmp_path / "lower")
    upper = tmp_path / "upper"
    subprocess.run(["cp", "-a", lower, upper], check=True)
    assert changes(upper, lower) == []

    mtime = (upper / "etc/sub/b").stat().st_mtime_ns
    (upper / "etc/sub/b").write_text("c\n")  # same size, same time: the bytes differ
    os.utime(upper / "etc/sub/b", ns=(mtime, mtime))
    shutil.rmtree(upper / "gone")
    (upper / "link").unlink()
    (upper / "link").symlink_to("etc/sub/b")
    (upper / "todir").unlink()
    (upper / "todir").mkdir()
    (upper / "todir" / "inside").write_text("")
    (upper / "bin" / "tool").chmod(0o700)
    os.setxattr(upper / "etc" / "a.conf", "user.knit-test", b"\x00\x01")
    assert changes(upper, lower) == [
        "bin/tool",
        "bin/tool2",  # the same inode
        "etc/a.conf",
        "etc/sub/b",
        ".wh.gone",
        "link",
        "todir",
        "todir/inside",
    ]


def test_a_layer_blob_its_digests_and_entries(tmp_path, cache_dir):
    lower = tree(tmp_path / "lower")
    upper = tmp_path / "upper"
    subprocess.run(["cp", "-a", lower, upper], check=True)
    (upper / "bin" / "tool").write_text("#!/bin/sh\necho new\n")
    (upper / "bin" / "tool").chmod(0o4755)
    shutil.rmtree(upper / "gone")
    os.setxattr(upper / "etc" / "a.conf", "user.knit-test", b"\xff\x00cap")

    layer = layers.write_layer("test", upper, lower)
    blob = cache.blob_path(layer.digest)
    assert blob.parent == cache_dir / "blobs" / "sha256"
    data = blob.read_bytes()
    assert (layer.digest, layer.size) == ("sha256:" + hashlib.sha256(data).hexdigest(), len(data))
    assert layer.diff_id == "sha256:" + hashlib.sha256(gzip.decompress(data)).hexdigest()
    with tarfile.open(blob) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert list(members) == ["bin/tool", "bin/tool2", "etc/a.conf", ".wh.gone"]
    assert members["bin/tool"].mode == 0o4755 and members["bin/tool"].uname == ""
    assert members["bin/tool2"].type == tarfile.LNKTYPE
    assert members["bin/tool2"].linkname == "bin/tool"
    xattr = members["etc/a.conf"].pax_headers["SCHILY.xattr.user.knit-test"]
    assert xattr.encode("utf-8", "surrogateescape") == b"\xff\x00cap"
    assert isinstance(members["etc/a.conf"].mtime, int)
    # the same tree gives the same blob
    assert layers.write_layer("test", upper, lower) == layer


def test_an_archive_of_an_image_and_its_index(tmp_path):
    binary = tmp_path / "pause"
    binary.write_bytes(b"\x7fELF" + b"\0" * 100)
    layer = layers.write_layer("pause", members=[layers.Member("pause", "file", source=binary)])
    spec = oci.ImageSpec("registry.example/a/b:1.2", [layer], {"Entrypoint": ["/pause"]})
    path = tmp_path / "out.tar"
    assert oci.write_archive(spec, path)
    assert not oci.write_archive(spec, path)  # already that image
    assert oci.image_names(path) == ["registry.example/a/b:1.2"]
    with tarfile.open(path) as tar:
        assert tar.getnames()[:4] == ["oci-layout", "index.json", "blobs", "blobs/sha256"]

        def read(name: str) -> bytes:
            f = tar.extractfile(name)
            assert f is not None, name
            return f.read()

        def blob(digest: str) -> bytes:
            data = read("blobs/" + digest.replace(":", "/"))
            assert hashlib.sha256(data).hexdigest() == digest.removeprefix("sha256:")
            return data

        (descriptor,) = json.loads(read("index.json"))["manifests"]
        assert descriptor["annotations"] == {
            "io.containerd.image.name": "registry.example/a/b:1.2",
            "org.opencontainers.image.ref.name": "1.2",
        }
        manifest_data = blob(descriptor["digest"])
        assert descriptor["size"] == len(manifest_data)
        manifest = json.loads(manifest_data)
        config = json.loads(blob(manifest["config"]["digest"]))
        assert config["rootfs"]["diff_ids"] == [layer.diff_id]
        assert config["config"] == {"Entrypoint": ["/pause"]}
        assert manifest["layers"] == [
            {"mediaType": oci.LAYER_MEDIA_TYPE, "digest": layer.digest, "size": layer.size}
        ]
        assert len(blob(layer.digest)) == layer.size


def elf(path: Path, segment_types: list[int]) -> Path:
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 32, 64)  # program headers right after the header
    struct.pack_into("<HH", header, 54, 56, len(segment_types))
    table = b"".join(struct.pack("<I", t) + b"\0" * 52 for t in segment_types)
    path.write_bytes(bytes(header) + table)
    return path


def test_static_elf(tmp_path):
    assert recipes.static_elf(elf(tmp_path / "static", [1, 1, 4]))
    assert not recipes.static_elf(elf(tmp_path / "dynamic", [6, 3, 1]))
    assert not recipes.static_elf(Path(sys.executable).resolve())
    (tmp_path / "script").write_text("#!/bin/sh\n")
    assert not recipes.static_elf(tmp_path / "script")
