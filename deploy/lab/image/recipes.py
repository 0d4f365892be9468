"""The lab's images and their build: knit's (knit.py), and the ones the cluster and the e2e
network tests run, as upstream has them:

- `registry.k8s.io/pause:3.10.2`: one static binary at /pause, run as 65535.
- `registry.k8s.io/e2e-test-images/agnhost:2.66.1`: the base rootfs, the tools agnhost and the
  e2e network tests execute, and the agnhost binary at /agnhost.
- `registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1`: agnhost's rootfs without agnhost,
  for the DNS specs' glibc querier (dig and getent over glibc's resolver).
- `registry.k8s.io/coredns/coredns:lab`: the cluster's DNS, one static binary at /coredns.

`build` writes one OCI archive per image (an archive already that image is left as it is) and
drops the cache's unused blobs, holding the cache's lock.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deploy.lab.image.cache import Layer, Step, cached_step, file_digest, key, locked, prune_blobs
from deploy.lab.image.errors import ImageError
from deploy.lab.image.knit import knit_image
from deploy.lab.image.layers import Member, write_layer
from deploy.lab.image.oci import ImageSpec, config_env, write_archive
from deploy.lab.image.steps import BASE_ENV, base_step, packages_step
from deploy.lab.paths import IMAGES, NODE_BIN

# where the other builds put these binaries
PAUSE_BINARY = IMAGES / "pause"
AGNHOST_BINARY = IMAGES / "agnhost"
COREDNS_BINARY = NODE_BIN / "coredns"
REGRESSION_74839_BINARY = IMAGES / "regression-issue-74839"

PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"
AGNHOST_IMAGE = "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
GLIBC_DNS_TESTING_IMAGE = "registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1"
COREDNS_IMAGE = "registry.k8s.io/coredns/coredns:lab"
# the images only the wider e2e selection (make e2e) runs, as v1.37.1's e2e.test names them
NGINX_IMAGE = "registry.k8s.io/e2e-test-images/nginx:1.27.0-2"
BUSYBOX_IMAGE = "registry.k8s.io/e2e-test-images/busybox:1.37.0-2"
DISTROLESS_IPTABLES_IMAGE = "registry.k8s.io/build-image/distroless-iptables:v0.9.7"
REGRESSION_74839_IMAGE = "registry.k8s.io/e2e-test-images/regression-issue-74839:1.5"
# What agnhost's subcommands and the e2e network specs execute in its containers.
AGNHOST_PACKAGES = (
    "curl",
    "wget",
    "netcat-openbsd",
    "dnsutils",
    "iproute2",
    "iputils-ping",
    "iptables",
    "conntrack",
    "procps",
    "ca-certificates",
)
# upstream's agnhost image: /agnhost-2 for the entrypoint tests, /uploads for netexec, porter's
# certificate (beside the binary, as go-tools builds them), `pause` as the default command and
# the ports its servers listen on
AGNHOST_PORTS = (80, 8080, 8081, 9376)
PT_INTERP = 3


def static_elf(path: Path) -> bool:
    """An ELF executable with no program interpreter (it needs no libraries)."""
    with path.open("rb") as f:
        header = f.read(64)
        if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:
            return False  # not a 64-bit ELF
        endian = "<" if header[5] == 1 else ">"
        (phoff,) = struct.unpack_from(endian + "Q", header, 32)
        phentsize, phnum = struct.unpack_from(endian + "HH", header, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    types = [struct.unpack_from(endian + "I", table, i * phentsize)[0] for i in range(phnum)]
    return PT_INTERP not in types


def _members_layer(name: str, members: list[Member]) -> Layer:
    """A layer of `members`, cached under the digests of their sources."""
    inputs = [
        (m.name, m.kind, m.mode, m.target, hashlib.sha256(m.data).hexdigest())
        + ((file_digest(m.source),) if m.source else ())
        for m in members
    ]
    step = cached_step(
        name,
        key(name, inputs),
        lambda _work: [write_layer(name, members=members)],
        keep_tree=False,
        log=lambda _: None,
    )
    return step.layers[0]


def _static_binary_image(
    name: str, image: str, binary: Path, config: dict[str, Any] | None = None
) -> ImageSpec:
    """An image of one static executable at /`name`, its entrypoint."""
    if not binary.is_file() or not static_elf(binary):
        raise ImageError(f"{binary} is not a static ELF executable")
    layer = _members_layer(name, [Member(name, "file", source=binary)])
    return ImageSpec(image, [layer], {"Entrypoint": [f"/{name}"], **(config or {})})


def pause_image(binary: Path) -> ImageSpec:
    """Upstream's pause image: /pause, run as 65535."""
    return _static_binary_image("pause", PAUSE_IMAGE, binary, {"User": "65535:65535"})


def coredns_image(binary: Path) -> ImageSpec:
    """Cluster DNS: /coredns alone (as root, where upstream's file capability lets a non-root
    user bind port 53)."""
    return _static_binary_image("coredns", COREDNS_IMAGE, binary)


def _agnhost_system(log: Callable[[str], None]) -> Step:
    """The base rootfs with AGNHOST_PACKAGES: agnhost's image and glibc-dns-testing's."""
    return packages_step("agnhost-packages", base_step(log), AGNHOST_PACKAGES, log)


def agnhost_image(binary: Path, log: Callable[[str], None]) -> ImageSpec:
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise ImageError(f"{binary} is not an executable file")
    system = _agnhost_system(log)
    layer = _members_layer(
        "agnhost",
        [
            Member("agnhost", "file", source=binary),
            Member("agnhost-2", "symlink", target="agnhost"),
            Member("uploads", "dir"),
            Member("usr/local/bin/agnhost", "symlink", target="/agnhost"),
            # porter serves its TLS ports with these, as upstream's image has them
            Member("localhost.crt", "file", mode=0o644, source=binary.parent / "localhost.crt"),
            Member("localhost.key", "file", mode=0o644, source=binary.parent / "localhost.key"),
        ],
    )
    config = {
        "Env": config_env(BASE_ENV),
        "Entrypoint": ["/agnhost"],
        "Cmd": ["pause"],
        "ExposedPorts": {f"{port}/tcp": {} for port in AGNHOST_PORTS},
    }
    return ImageSpec(AGNHOST_IMAGE, [*system.layers, layer], config)


def glibc_dns_testing_image(log: Callable[[str], None]) -> ImageSpec:
    """The e2e DNS specs' glibc querier: a shell script of dig and getent over glibc's
    resolver, which agnhost's Debian rootfs holds (dnsutils, libc-bin)."""
    config = {"Env": config_env(BASE_ENV), "Cmd": ["/bin/sh"]}
    return ImageSpec(GLIBC_DNS_TESTING_IMAGE, list(_agnhost_system(log).layers), config)


def nginx_image(log: Callable[[str], None]) -> ImageSpec:
    """nginx serving its default page on port 80 of both families, as upstream's image does:
    Debian's nginx package in the foreground."""
    system = packages_step("nginx-packages", base_step(log), ("nginx",), log)
    config = {
        "Env": config_env(BASE_ENV),
        "Cmd": ["nginx", "-g", "daemon off;"],
        "ExposedPorts": {"80/tcp": {}},
    }
    return ImageSpec(NGINX_IMAGE, list(system.layers), config)


def shell_tools_image(name: str, log: Callable[[str], None]) -> ImageSpec:
    """An image the specs only run shell tools in (busybox: sh, nc, sleep; distroless-iptables:
    iptables, conntrack, sleep): agnhost's Debian rootfs, which holds them all. A busybox-static
    build was tried first: its wget segfaulted where the specs run it."""
    config = {"Env": config_env(BASE_ENV), "Cmd": ["sh"]}
    return ImageSpec(name, list(_agnhost_system(log).layers), config)


def _archives(output: Path, specs: Callable[[], list[tuple[str, ImageSpec]]]) -> dict[str, Path]:
    """Build the images `specs` makes (under the cache's lock) into output/FILENAME.tar;
    returns image name -> archive."""
    if os.geteuid() != 0:
        raise ImageError("building the images needs root (debootstrap, chroot)")
    output.mkdir(parents=True, exist_ok=True)
    archives = {}
    with locked():
        for filename, spec in specs():
            path = output / f"{filename}.tar"
            write_archive(spec, path)
            archives[spec.name] = path
        prune_blobs()
    return archives


def build(
    output: Path,
    pause: Path | None,
    agnhost: Path | None,
    coredns: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Path]:
    """Build knit's image (and pause's, agnhost's with glibc-dns-testing's, and CoreDNS's when
    their binaries are given) into output/NAME.tar; returns image name -> archive."""

    def specs() -> list[tuple[str, ImageSpec]]:
        made = [("knit", knit_image(log))]
        if pause is not None:
            made.append(("pause", pause_image(pause)))
        if agnhost is not None:
            made.append(("agnhost", agnhost_image(agnhost, log)))
            made.append(("glibc-dns-testing", glibc_dns_testing_image(log)))
        if coredns is not None:
            made.append(("coredns", coredns_image(coredns)))
        return made

    return _archives(output, specs)


def build_e2e_images(output: Path, log: Callable[[str], None] = print) -> dict[str, Path]:
    """The images only the wider e2e selection needs, into output/NAME.tar; returns image
    name -> archive."""
    regression = "regression-issue-74839"
    return _archives(
        output,
        lambda: [
            ("nginx", nginx_image(log)),
            ("busybox", shell_tools_image(BUSYBOX_IMAGE, log)),
            ("distroless-iptables", shell_tools_image(DISTROLESS_IPTABLES_IMAGE, log)),
            (
                regression,
                _static_binary_image(regression, REGRESSION_74839_IMAGE, REGRESSION_74839_BINARY),
            ),
        ],
    )


def build_knit_release(output: Path, release: str, log: Callable[[str], None] = print) -> Path:
    """knit's image as another release (see knit_image) into output/knit-RELEASE.tar."""
    archives = _archives(output, lambda: [(f"knit-{release}", knit_image(log, release))])
    (archive,) = archives.values()
    return archive


def build_lab_images(output: Path) -> dict[str, Path]:
    """Every image the lab's cluster runs, from the binaries `make go-tools` built."""
    return build(output, PAUSE_BINARY, AGNHOST_BINARY, COREDNS_BINARY)
