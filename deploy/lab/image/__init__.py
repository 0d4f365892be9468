"""Container images for the lab, built without Docker, as OCI image layout archives.

    python -m deploy.lab.image build --output DIR [--pause BIN] [--agnhost BIN]

writes DIR/knit.tar and, given their binaries, DIR/pause.tar, DIR/agnhost.tar and
DIR/glibc-dns-testing.tar, which containerd imports with its own client (`import_images`:
`ctr -n k8s.io images import --all-platforms -`); the lab (`build_lab_images`) adds CoreDNS's.
Needs root, debootstrap, unshare, and the Debian mirror and PyPI over the network on a cold
build. Everything expensive is cached under build/images/cache/, keyed on its inputs: a warm
build only hashes its inputs and writes the archives (skipped when the archive on disk is
already that image).

The modules, each owning one part:

- dockerfile: the Dockerfile parser (the Dockerfile names what goes into knit's image).
- cache: the build cache, its keys, blobs and cached steps.
- layers: a tree's changes, or single entries, as a layer blob.
- steps: the Debian rootfs steps (debootstrap, apt packages) and chroot.
- oci: an image's OCI documents, the archive, and containerd's import of it.
- knit: knit's image, from the Dockerfile.
- recipes: pause, agnhost, glibc-dns-testing and CoreDNS, and `build` of them all.
- __main__: the command line.

What the package exports is what the lab and the build's integration test use of it.
"""

from __future__ import annotations

from deploy.lab.image.cache import mounts_under
from deploy.lab.image.dockerfile import Dockerfile, read_dockerfile
from deploy.lab.image.knit import CLIENT, KNIT_BASE_PACKAGES, KNIT_IMAGE, PORTMAP
from deploy.lab.image.oci import image_names, import_images
from deploy.lab.image.recipes import (
    AGNHOST_BINARY,
    AGNHOST_IMAGE,
    AGNHOST_PACKAGES,
    BUSYBOX_IMAGE,
    DISTROLESS_IPTABLES_IMAGE,
    GLIBC_DNS_TESTING_IMAGE,
    NGINX_IMAGE,
    PAUSE_BINARY,
    PAUSE_IMAGE,
    REGRESSION_74839_BINARY,
    REGRESSION_74839_IMAGE,
    build,
    build_e2e_images,
    build_knit_release,
    build_lab_images,
)
from deploy.lab.image.steps import BASE_ENV, chroot

__all__ = [
    "AGNHOST_BINARY",
    "AGNHOST_IMAGE",
    "AGNHOST_PACKAGES",
    "BASE_ENV",
    "BUSYBOX_IMAGE",
    "CLIENT",
    "DISTROLESS_IPTABLES_IMAGE",
    "GLIBC_DNS_TESTING_IMAGE",
    "KNIT_BASE_PACKAGES",
    "KNIT_IMAGE",
    "NGINX_IMAGE",
    "PAUSE_BINARY",
    "PAUSE_IMAGE",
    "PORTMAP",
    "REGRESSION_74839_BINARY",
    "REGRESSION_74839_IMAGE",
    "Dockerfile",
    "build",
    "build_e2e_images",
    "build_knit_release",
    "build_lab_images",
    "chroot",
    "image_names",
    "import_images",
    "mounts_under",
    "read_dockerfile",
]
