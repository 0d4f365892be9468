"""knit's image, `docker.io/library/knit:dev` (the DaemonSet's `knit:dev` as kubelet normalises
it): what the repository's Dockerfile describes, built on a Debian rootfs.

The apt packages, ENV, USER and ENTRYPOINT come from the Dockerfile's final stage, the build
context (what `pip install .` sees) and the pip settings from its builder stage; the Dockerfile
stays the one place that names them. Layers: the base rootfs, the packages, then /opt/knit (the
venv and the cni-bundle, built in the rootfs from wheels this environment's pip downloads).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deploy.lab.image.cache import (
    CACHE,
    Layer,
    cached_step,
    file_digest,
    key,
    remove_other_keys,
    remove_tree,
)
from deploy.lab.image.dockerfile import Stage, read_dockerfile
from deploy.lab.image.errors import ImageError
from deploy.lab.image.layers import write_layer
from deploy.lab.image.oci import ImageSpec, config_env
from deploy.lab.image.steps import BASE_ENV, base_step, chroot, copy_tree, packages_step, run
from deploy.lab.paths import PLUGIN_DIR, REFERENCE_PLUGINS, ROOT

PORTMAP = REFERENCE_PLUGINS / "portmap"
# the Dockerfile's client stage runs the Makefile's rule; `make cni` runs it here (static, so
# the build machine's binary is the image's)
CLIENT = PLUGIN_DIR / "knit"
KNIT_REPOSITORY = "docker.io/library/knit"
KNIT_IMAGE = f"{KNIT_REPOSITORY}:dev"
# python:3.11-slim has python and venv built in; Debian splits venv (ensurepip) out.
KNIT_BASE_PACKAGES = ("python3", "python3-venv")
VENV = "/opt/knit/venv"
BUNDLE = "/opt/knit/cni-bundle"
BUILD_DIR = "tmp/knit-build"  # in a rootfs, removed before the step's layer is taken


def _context_files(stage: Stage) -> list[tuple[Path, str]]:
    """(file in the repository, path relative to the WORKDIR) for the stage's COPYs from the
    build context, as Docker copies them (a directory's contents into the destination), without
    caches (as .dockerignore has it)."""
    files: list[tuple[Path, str]] = []
    for from_stage, sources, destination in stage.copies():
        if from_stage is not None:
            continue
        if destination.startswith("/"):
            raise ImageError(f"COPY to {destination}: only WORKDIR-relative ones are supported")
        into = destination.endswith("/") or len(sources) > 1
        for source in sources:
            path = ROOT / source
            if path.is_dir():
                files += [
                    (file, os.path.normpath(f"{destination}/{file.relative_to(path)}"))
                    for file in sorted(path.rglob("*"))
                    if file.is_file() and "__pycache__" not in file.parts and file.suffix != ".pyc"
                ]
            elif path.is_file():
                target = f"{destination}/{path.name}" if into else destination
                files.append((path, os.path.normpath(target)))
            else:
                raise ImageError(f"the Dockerfile copies {source}, which is missing")
    return files


def _python_version(rootfs: Path) -> str:
    link = os.readlink(rootfs / "usr/bin/python3")
    match = re.fullmatch(r"python(\d+\.\d+)", Path(link).name)
    if match is None:
        raise ImageError(f"cannot tell the Python version of {rootfs} from python3 -> {link}")
    return match[1]


def _glibc_version(rootfs: Path) -> tuple[int, int]:
    status = (rootfs / "var/lib/dpkg/status").read_text()
    match = re.search(r"^Package: libc6\n(?:.+\n)*?Version: (\d+)\.(\d+)", status, re.M)
    if match is None:
        raise ImageError("no libc6 in the rootfs's dpkg status")
    return int(match[1]), int(match[2])


def _wheelhouse(python: str, glibc: tuple[int, int], log: Callable[[str], None]) -> Path:
    """Wheels of the project's dependencies and build requirements for the image's Python,
    downloaded by this environment's pip (the image's pip installs them with no network).
    Binary wheels only: the image has no compiler."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requirements = [
        *project["build-system"]["requires"],
        *project["project"]["dependencies"],
    ]
    machine = platform.machine()
    platforms = [f"manylinux_{glibc[0]}_{minor}_{machine}" for minor in range(glibc[1], 16, -1)]
    platforms += [f"manylinux2014_{machine}", f"manylinux2010_{machine}", f"manylinux1_{machine}"]
    directory = CACHE / f"wheels-{key('wheels', python, platforms, requirements)}"
    if (directory / ".complete").is_file():
        return directory
    log(f"downloading wheels for Python {python}")
    remove_tree(directory)
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    argv += ["--only-binary=:all:", "--python-version", python, "--dest", str(directory)]
    for name in platforms:
        argv += ["--platform", name]
    run([*argv, *requirements])
    (directory / ".complete").touch()
    remove_other_keys(directory)
    return directory


def knit_image(log: Callable[[str], None], release: str = "") -> ImageSpec:
    """knit's image as the Dockerfile describes it, on a Debian rootfs.

    `release` names another release of the same sources (tagged knit:RELEASE): one more module,
    cni/_release.py naming it, is built in, so its plugin bundle has another version, as a new
    release's would; a rolling update to it must leave that bundle on every node."""
    dockerfile = read_dockerfile()
    final = dockerfile.final
    builder_names = {name for name, _, _ in final.copies() if name is not None}
    if len(builder_names) != 1:
        raise ImageError(f"the final stage copies from {builder_names}, expected one builder")
    builder = dockerfile.stage(builder_names.pop())
    packages = [*KNIT_BASE_PACKAGES, *final.apt_packages()]
    if not PORTMAP.is_file():
        raise ImageError(f"{PORTMAP} is missing (make go-tools builds it)")
    if not CLIENT.is_file():
        raise ImageError(f"{CLIENT} is missing (make cni builds it)")

    system = packages_step("knit-packages", base_step(log), packages, log)
    lower = system.rootfs()
    wheels = _wheelhouse(_python_version(lower), _glibc_version(lower), log)
    context = _context_files(builder)
    inputs = [(target, file_digest(path)) for path, target in context]
    # the builder's ENV for pip (PIP_NO_CACHE_DIR, ...); the commands name the venv's paths
    pip_env = {k: v for k, v in builder.env(BASE_ENV).items() if k.startswith("PIP_")}

    def build(work: Path) -> list[Layer]:
        rootfs = work / "rootfs"
        copy_tree(lower, rootfs)
        build_dir = rootfs / BUILD_DIR
        for path, target in context:
            (build_dir / "src" / target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, build_dir / "src" / target)
        if release:
            (build_dir / "src" / "cni" / "_release.py").write_text(f"RELEASE = {release!r}\n")
        shutil.copytree(wheels, build_dir / "wheels")
        shutil.copy2(PORTMAP, build_dir / "portmap")
        shutil.copy2(CLIENT, build_dir / "knit-client")
        inside = "/" + BUILD_DIR
        chroot(rootfs, "python3", "-m", "venv", VENV)
        chroot(
            rootfs,
            f"{VENV}/bin/pip",
            "install",
            "--no-index",
            "--find-links",
            f"{inside}/wheels",
            f"{inside}/src",
            env=pip_env,
        )
        # Debian's binaries are stripped already; cni.bundle strips only where binutils is
        chroot(
            rootfs,
            f"{VENV}/bin/python",
            "-m",
            "cni.bundle",
            "--output",
            BUNDLE,
            "--client",
            f"{inside}/knit-client",
            "--plugin",
            f"{inside}/portmap",
        )
        remove_tree(build_dir)
        for _, sources, destination in final.copies():
            if not (rootfs / destination.lstrip("/")).is_dir():
                raise ImageError(f"the Dockerfile copies {sources} to {destination}: not built")
        return [*system.layers, write_layer("knit: venv and cni-bundle", rootfs, lower)]

    # a release is a step of its own: a step keeps one key, and each image must stay cached
    name = f"knit-{release}" if release else "knit"
    knit_key = key(
        name, system.key, wheels.name, inputs, file_digest(PORTMAP), file_digest(CLIENT), pip_env
    )
    step = cached_step(name, knit_key, build, keep_tree=False, log=log)
    config: dict[str, Any] = {
        "Env": config_env(final.env(BASE_ENV)),
        "Entrypoint": final.entrypoint(),
    }
    if final.cmd() is not None:
        config["Cmd"] = final.cmd()
    if final.user():
        config["User"] = final.user()
    if final.workdir():
        config["WorkingDir"] = final.workdir()
    return ImageSpec(f"{KNIT_REPOSITORY}:{release}" if release else KNIT_IMAGE, step.layers, config)
