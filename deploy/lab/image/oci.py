"""OCI images: an image's config, manifest and index as the OCI image spec has them, written
with its layer blobs as an OCI image layout tar, and such archives read (their image names) and
imported into containerd with its own client, `ctr images import`.

The archive has index.json at its start (after oci-layout), so a rebuild tells from the first
members of the file on disk whether it already is the image, and leaves it then; containerd
names the image it imports after the index's io.containerd.image.name annotation.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.lab.image.cache import Layer, blob_path
from deploy.lab.image.errors import ImageError
from deploy.lab.image.layers import Member, add_member

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
NAME_ANNOTATION = "io.containerd.image.name"
REF_ANNOTATION = "org.opencontainers.image.ref.name"
ARCHITECTURES = {"x86_64": "amd64", "aarch64": "arm64"}


@dataclass
class ImageSpec:
    """An image: its layers (bottom first) and its config's `config` (Entrypoint, Env, ...)."""

    name: str  # fully qualified: registry/repository:tag
    layers: list[Layer]
    config: dict[str, Any]


def config_env(env: dict[str, str]) -> list[str]:
    """An environment as an image config's Env."""
    return [f"{k}={v}" for k, v in env.items()]


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _descriptor(media_type: str, data: bytes) -> dict[str, Any]:
    return {
        "mediaType": media_type,
        "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
        "size": len(data),
    }


def _documents(image: ImageSpec) -> tuple[bytes, bytes, bytes]:
    """The image's config, manifest and index.json."""
    architecture = ARCHITECTURES.get(platform.machine(), platform.machine())
    config = _json(
        {
            "architecture": architecture,
            "os": "linux",
            "config": image.config,
            "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in image.layers]},
            "history": [{"created_by": layer.comment} for layer in image.layers],
        }
    )
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": _descriptor(CONFIG_MEDIA_TYPE, config),
            "layers": [
                {"mediaType": LAYER_MEDIA_TYPE, "digest": layer.digest, "size": layer.size}
                for layer in image.layers
            ],
        }
    )
    index = _json(
        {
            "schemaVersion": 2,
            "mediaType": INDEX_MEDIA_TYPE,
            "manifests": [
                {
                    **_descriptor(MANIFEST_MEDIA_TYPE, manifest),
                    "platform": {"architecture": architecture, "os": "linux"},
                    "annotations": {
                        NAME_ANNOTATION: image.name,
                        REF_ANNOTATION: image.name.rpartition(":")[2],
                    },
                }
            ],
        }
    )
    return config, manifest, index


def _read_index(archive: Path) -> dict[str, Any] | None:
    """index.json of an OCI archive, read from the members ahead of it (it comes first)."""
    try:
        with tarfile.open(archive, "r:") as tar:
            for _ in range(3):
                member = tar.next()
                if member is None:
                    return None
                if member.name == "index.json":
                    f = tar.extractfile(member)
                    return json.loads(f.read()) if f else None
    except (OSError, tarfile.TarError, json.JSONDecodeError):
        return None
    return None


def _blob_name(digest: str) -> str:
    return "blobs/" + digest.replace(":", "/")


def write_archive(image: ImageSpec, path: Path) -> bool:
    """The image as an OCI image layout tar at `path`; False when `path` already is it."""
    config, manifest, index = _documents(image)
    if _read_index(path) == json.loads(index):
        return False
    tmp = path.with_name(f".{path.name}.tmp")
    manifest_digest = json.loads(index)["manifests"][0]["digest"]
    config_digest = json.loads(manifest)["config"]["digest"]
    documents = sorted({manifest_digest: manifest, config_digest: config}.items())
    layers = sorted({layer.digest for layer in image.layers})
    members = [
        Member("oci-layout", "file", mode=0o644, data=_json({"imageLayoutVersion": "1.0.0"})),
        Member("index.json", "file", mode=0o644, data=index),
        Member("blobs", "dir"),
        Member("blobs/sha256", "dir"),
        *(Member(_blob_name(d), "file", mode=0o644, data=data) for d, data in documents),
        *(Member(_blob_name(d), "file", mode=0o644, source=blob_path(d)) for d in layers),
    ]
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for member in members:
            add_member(tar, member)
    tmp.replace(path)
    return True


def image_names(archive: Path) -> list[str]:
    index = _read_index(archive)
    if index is None:
        raise ImageError(f"{archive} is not an OCI image archive with index.json first")
    return [m["annotations"][NAME_ANNOTATION] for m in index["manifests"]]


def import_images(ctr_argv: list[str], archives: Iterable[Path]) -> list[str]:
    """Import the archives with containerd's client: `ctr_argv` is the command up to the
    subcommand, e.g. ["ctr", "--address", SOCK, "-n", "k8s.io"] (or run in a node through
    nsenter/docker exec -i: the archive goes through stdin). Returns the names imported."""
    names = []
    for archive in archives:
        names += image_names(archive)
        with Path(archive).open("rb") as stdin:
            result = subprocess.run(
                [*ctr_argv, "images", "import", "--all-platforms", "-"],
                stdin=stdin,
                capture_output=True,
                text=True,
                check=False,
            )
        if result.returncode != 0:
            raise ImageError(f"importing {archive} failed: {result.stderr.strip()}")
    return names
