"""Container images for the lab, built without Docker, as OCI image layout archives.

    python -m deploy.lab.image build --output DIR [--pause BIN] [--agnhost BIN]

writes DIR/knit.tar, DIR/pause.tar and DIR/agnhost.tar, which containerd imports with its own
client (`import_images`: `ctr -n k8s.io images import --all-platforms -`):

- `docker.io/library/knit:dev` (the DaemonSet's `knit:dev` as kubelet normalises it): what the
  repository's Dockerfile describes, on a Debian rootfs. The apt packages, ENV, USER and
  ENTRYPOINT come from the Dockerfile's final stage, the build context (what `pip install .`
  sees) and the pip settings from its builder stage; the Dockerfile stays the one place that
  names them. Layers: the base rootfs, the packages, then /opt/knit (venv and cni-bundle).
- `registry.k8s.io/pause:3.10.2`: one static binary at /pause.
- `registry.k8s.io/e2e-test-images/agnhost:2.66.1`: the base rootfs, the tools agnhost and
  the e2e network tests execute, and the agnhost binary at /agnhost.

The base rootfs is Debian bookworm from debootstrap (variant minbase), brought up to date from
bookworm-updates and bookworm-security; knit's and agnhost's images share its layer. Chroot
steps run inside `unshare --mount --propagation private`, so the proc and tmpfs mounts they
make (and the ones debootstrap makes) die with them. Needs root, debootstrap, unshare, and the
Debian mirror and PyPI over the network on a cold build.

Everything expensive is cached under build/images/cache/, keyed on its inputs: a rootfs tree
per step (base, each image's packages) and every layer as a blob. A warm build only hashes its
inputs and writes the archives (skipped when the archive on disk is already that image).
The base is keyed on the recipe, not on the day: remove build/images/cache/ for fresh packages.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import io
import json
import os
import platform
import re
import shlex
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
IMAGES_DIR = ROOT / "build" / "images"
CACHE = IMAGES_DIR / "cache"
PORTMAP = ROOT / "build" / "refcni" / "portmap"
# where the other builds put these binaries
PAUSE_BINARY = IMAGES_DIR / "pause"
AGNHOST_BINARY = IMAGES_DIR / "agnhost"
COREDNS_BINARY = ROOT / "build" / "node" / "coredns"

KNIT_IMAGE = "docker.io/library/knit:dev"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"
AGNHOST_IMAGE = "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
COREDNS_IMAGE = "registry.k8s.io/coredns/coredns:lab"
GLIBC_DNS_TESTING_IMAGE = "registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1"

# Bump when a step's recipe changes in a way its other inputs do not show.
RECIPE = 2
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
SOURCES = (
    f"deb {MIRROR} {SUITE} main\n"
    f"deb {MIRROR} {SUITE}-updates main\n"
    f"deb http://deb.debian.org/debian-security {SUITE}-security main\n"
)
# The environment a Debian image starts with (debian:bookworm's PATH). The Dockerfile's base,
# python:3.11-slim, has its own Python in /usr/local (PATH=/usr/local/bin:... and LANG=C.UTF-8
# for it); here Python is Debian's python3 in /usr/bin, so the final PATH lacks that extra
# /usr/local/bin. LANG=C.UTF-8 is kept as the python image sets it.
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
# python:3.11-slim has python and venv built in; Debian splits venv (ensurepip) out.
KNIT_BASE_PACKAGES = ("python3", "python3-venv")
VENV = "/opt/knit/venv"
BUNDLE = "/opt/knit/cni-bundle"
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
# upstream's agnhost image: /agnhost-2 for the entrypoint tests, /uploads for netexec, `pause`
# as the default command and the ports its servers listen on
AGNHOST_PORTS = (80, 8080, 8081, 9376)
BUILD_DIR = "tmp/knit-build"  # in a rootfs, removed before the step's layer is taken
CHROOT_PATH = BASE_ENV["PATH"]
LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
NAME_ANNOTATION = "io.containerd.image.name"
REF_ANNOTATION = "org.opencontainers.image.ref.name"
ARCHITECTURES = {"x86_64": "amd64", "aarch64": "arm64"}
# The only extended attribute Debian's packages set (iputils-ping's cap_net_raw).
XATTRS = ("security.capability",)
GZIP_LEVEL = 6


class ImageError(Exception):
    pass


# ---------------------------------------------------------------- the Dockerfile


class DockerfileError(ImageError):
    pass


@dataclass
class Instruction:
    keyword: str  # upper case
    args: str  # after the keyword and its --flags
    flags: dict[str, str] = field(default_factory=dict)


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def _all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment after the stage's ENV instructions, starting from `base`: values
        substituted as Docker does (${VAR} from the environment and the stage's ARGs; within
        one instruction, from before it), a key keeping its place when set again."""
        env = dict(base or {})
        args: dict[str, str] = {}
        for instruction in self.instructions:
            if instruction.keyword == "ARG":
                name, has_default, default = instruction.args.partition("=")
                if has_default:
                    args[name.strip()] = words(default, {**args, **env})[0] if default else ""
            elif instruction.keyword == "ENV":
                env.update(_env_pairs(instruction.args, {**args, **env}))
        return env

    def apt_packages(self) -> list[str]:
        """The packages `apt-get install` / `apt install` names in the stage's RUNs, in order."""
        packages: list[str] = []
        for instruction in self._all("RUN"):
            for argv in _shell_commands(instruction.args):
                packages.extend(p for p in _apt_install(argv) if p not in packages)
        return packages

    def entrypoint(self) -> list[str] | None:
        found = self._all("ENTRYPOINT")
        return _command_form(found[-1].args) if found else None

    def cmd(self) -> list[str] | None:
        """CMD; an ENTRYPOINT after the last CMD resets it, as in Docker."""
        cmd = None
        for instruction in self.instructions:
            if instruction.keyword == "CMD":
                cmd = _command_form(instruction.args)
            elif instruction.keyword == "ENTRYPOINT":
                cmd = None
        return cmd

    def user(self) -> str | None:
        found = self._all("USER")
        return found[-1].args.strip() if found else None

    def workdir(self) -> str | None:
        found = self._all("WORKDIR")
        return found[-1].args.strip() if found else None

    def copies(self) -> list[tuple[str | None, list[str], str]]:
        """(--from or None, sources, destination) of every COPY and ADD."""
        result: list[tuple[str | None, list[str], str]] = []
        for instruction in self.instructions:
            if instruction.keyword in ("COPY", "ADD"):
                parts = (
                    _json_list(instruction.args)
                    if instruction.args.lstrip().startswith("[")
                    else shlex.split(instruction.args)
                )
                if len(parts) < 2:
                    raise DockerfileError(f"{instruction.keyword} {instruction.args}: no target")
                result.append((instruction.flags.get("from"), parts[:-1], parts[-1]))
        return result


@dataclass
class Dockerfile:
    args: dict[str, str]  # the ARGs before the first FROM, with their defaults
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise DockerfileError(f"no stage named {name!r}")


FLAG = re.compile(r"--([a-z-]+)(?:=(\S*))?$")


def parse_dockerfile(text: str) -> Dockerfile:
    """The instructions of a Dockerfile, by stage. Covers what this project's Dockerfile uses:
    line continuations, comment lines (also inside a continuation), --flags, ARG before FROM;
    no heredocs and no `# escape=` directive (refused)."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        keyword, _, rest = line.strip().partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        flags: dict[str, str] = {}
        while rest.startswith("--"):
            flag, _, remainder = rest.partition(" ")
            match = FLAG.match(flag)
            if match is None:
                raise DockerfileError(f"cannot read the flag {flag!r} of {keyword}")
            flags[match[1]] = match[2] or ""
            rest = remainder.strip()
        if keyword in ("RUN", "COPY", "ADD") and re.search(r"<<-?['\"]?[A-Za-z_]", rest):
            raise DockerfileError(f"heredocs are not supported: {keyword} {rest}")
        if keyword == "FROM":
            image, *alias = rest.split()
            if alias and (len(alias) != 2 or alias[0].upper() != "AS"):
                raise DockerfileError(f"cannot read FROM {rest}")
            base = substitute(image, args)
            stages.append(Stage(base=base, name=alias[1] if alias else ""))
        elif not stages:
            if keyword != "ARG":
                raise DockerfileError(f"{keyword} before the first FROM")
            name, _, default = rest.partition("=")
            args[name.strip()] = words(default, args)[0] if default else ""
        else:
            stages[-1].instructions.append(Instruction(keyword, rest, flags))
    if not stages:
        raise DockerfileError("no FROM")
    return Dockerfile(args, stages)


def read_dockerfile(path: Path = DOCKERFILE) -> Dockerfile:
    return parse_dockerfile(path.read_text())


def _logical_lines(text: str) -> Iterator[str]:
    pending: list[str] = []
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#"):
            if not pending and re.match(r"#\s*escape\s*=", stripped):
                raise DockerfileError("the escape directive is not supported")
            continue
        if not stripped:
            if pending:
                continue  # an empty line inside a continuation, as Docker allows
            continue
        if stripped.endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        yield " ".join(part.strip() for part in [*pending, raw])
        pending = []
    if pending:
        raise DockerfileError("the last instruction ends in a line continuation")


def _expand(text: str, i: int, env: dict[str, str]) -> tuple[str, int]:
    """The value of the variable reference at text[i] == '$', and the index after it."""
    if text.startswith("${", i):
        end = text.find("}", i)
        if end < 0:
            raise DockerfileError(f"unterminated ${{ in {text!r}")
        inner = text[i + 2 : end]
        match = re.fullmatch(r"(\w+)(?::([-+])(.*))?", inner)
        if match is None:
            raise DockerfileError(f"unsupported substitution ${{{inner}}}")
        name, op, word = match.groups()
        value = env.get(name, "")
        if op == "-":
            value = value or "".join(words(word, env))
        elif op == "+":
            value = "".join(words(word, env)) if value else ""
        return value, end + 1
    match = re.compile(r"\w+").match(text, i + 1)
    if match is None:
        return "$", i + 1
    return env.get(match[0], ""), match.end()


def words(text: str, env: dict[str, str]) -> list[str]:
    """Docker's word processing: split at unquoted blanks, quotes removed, backslash escapes,
    $VAR/${VAR}/${VAR:-word}/${VAR:+word} substituted except inside single quotes; an unset
    variable is empty."""
    result: list[str] = []
    current: list[str] = []
    started = False
    quote = ""
    i = 0
    while i < len(text):
        char = text[i]
        if quote == "'":
            if char == "'":
                quote = ""
            else:
                current.append(char)
            i += 1
        elif char == "\\" and i + 1 < len(text) and (not quote or text[i + 1] in '"$\\'):
            current.append(text[i + 1])
            i += 2
        elif char == "$":
            value, i = _expand(text, i, env)
            current.append(value)
            started = True
        elif quote == '"':
            if char == '"':
                quote = ""
            else:
                current.append(char)
            i += 1
        elif char in "'\"":
            quote = char
            started = True
            i += 1
        elif char.isspace():
            if current or started:
                result.append("".join(current))
            current, started = [], False
            i += 1
        else:
            current.append(char)
            i += 1
    if quote:
        raise DockerfileError(f"unterminated quote in {text!r}")
    if current or started:
        result.append("".join(current))
    return result


def substitute(text: str, env: dict[str, str]) -> str:
    """`text` with its variables substituted and its quotes removed, blanks kept."""
    return " ".join(words(text, env))


def _env_pairs(text: str, env: dict[str, str]) -> dict[str, str]:
    parts = words(text, env)
    if parts and "=" not in parts[0]:
        # the legacy `ENV KEY value with blanks` form
        key, _, value = text.strip().partition(" ")
        return {key: substitute(value.strip(), env)}
    pairs = {}
    for part in parts:
        key, has_value, value = part.partition("=")
        if not has_value or not key:
            raise DockerfileError(f"ENV {text}: {part!r} is not KEY=VALUE")
        pairs[key] = value
    return pairs


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise DockerfileError(f"not a JSON list: {text}") from err
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DockerfileError(f"not a JSON list of strings: {text}")
    return value


def _command_form(text: str) -> list[str]:
    """An ENTRYPOINT's or CMD's argv: the exec (JSON) form, or the shell form under sh -c."""
    text = text.strip()
    if text.startswith("["):
        with contextlib.suppress(DockerfileError):
            return _json_list(text)
    return ["/bin/sh", "-c", text]


def _shell_commands(text: str) -> list[list[str]]:
    """A RUN's simple commands: the exec form, or the shell form split at && || ; | and &."""
    if text.lstrip().startswith("["):
        with contextlib.suppress(DockerfileError):
            return [_json_list(text)]
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    try:
        for token in lexer:
            if token and set(token) <= set("&|;()"):
                commands.append([])
            else:
                commands[-1].append(token)
    except ValueError as err:
        raise DockerfileError(f"cannot split RUN {text}: {err}") from err
    return [command for command in commands if command]


APT_OPTIONS_WITH_VALUE = {"-o", "-t", "-c", "--option", "--target-release", "--config-file"}


def _apt_install(argv: list[str]) -> list[str]:
    """The packages of an `apt-get install`/`apt install` command, else nothing."""
    argv = list(argv)
    if argv and argv[0] == "env":
        argv.pop(0)
    while argv and re.match(r"\w+=", argv[0]):
        argv.pop(0)
    if not argv or Path(argv[0]).name not in ("apt-get", "apt"):
        return []
    operands: list[str] = []
    args = iter(argv[1:])
    for arg in args:
        if arg in APT_OPTIONS_WITH_VALUE:
            next(args, None)
        elif not arg.startswith("-"):
            operands.append(arg)
    if not operands or operands[0] != "install":
        return []
    return operands[1:]


# ---------------------------------------------------------------- layers


class _HashingWriter(io.RawIOBase):
    """A write-only stream that hashes and counts what passes through to `target`."""

    def __init__(self, target: IO[bytes]) -> None:
        self.target = target
        self.sha256 = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.target.write(view)
        self.size += view.nbytes
        return view.nbytes


@dataclass(frozen=True)
class Layer:
    digest: str  # sha256:... of the gzip blob
    diff_id: str  # sha256:... of the tar
    size: int
    comment: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "diff_id": self.diff_id,
            "size": self.size,
            "comment": self.comment,
        }


@dataclass
class ImageSpec:
    """An image: its layers (bottom first) and its config's `config` (Entrypoint, Env, ...)."""

    name: str  # fully qualified: registry/repository:tag
    layers: list[Layer]
    config: dict[str, Any]


def blob_path(digest: str) -> Path:
    algorithm, _, hexdigest = digest.partition(":")
    return CACHE / "blobs" / algorithm / hexdigest


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def _special(mode: int) -> bool:
    """Device nodes, FIFOs and sockets: never in a layer (the runtime makes /dev)."""
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))


def _xattrs(path: Path) -> dict[str, bytes]:
    found = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    for name in names:
        if name in XATTRS:
            found[name] = os.getxattr(path, name, follow_symlinks=False)
    return found


@dataclass
class _Entry:
    path: str  # relative to the tree, "/"-separated
    whiteout: bool = False


def _listdir(directory: Path | None) -> dict[str, os.stat_result]:
    if directory is None:
        return {}
    entries = {}
    with os.scandir(directory) as it:
        for entry in it:
            st = entry.stat(follow_symlinks=False)
            if not _special(st.st_mode):
                entries[entry.name] = st
    return entries


def _same_file(a: Path, b: Path) -> bool:
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            chunk = fa.read(1 << 20)
            if chunk != fb.read(1 << 20):
                return False
            if not chunk:
                return True


def _unchanged(lower: Path, lst: os.stat_result, upper: Path, ust: os.stat_result) -> bool:
    def meta(st: os.stat_result) -> tuple[int, ...]:
        return (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)

    if meta(lst) != meta(ust) or _xattrs(lower) != _xattrs(upper):
        return False
    if stat.S_ISLNK(ust.st_mode):
        return os.readlink(lower) == os.readlink(upper)
    if lst.st_mtime_ns != ust.st_mtime_ns:
        return False
    if stat.S_ISREG(ust.st_mode):
        return lst.st_size == ust.st_size and _same_file(lower, upper)
    return True


def tree_changes(upper: Path, lower: Path | None = None, prefix: str = "") -> Iterator[_Entry]:
    """What a layer over `lower` needs for `upper`: new and changed entries (a new directory
    with everything in it), and a whiteout for what `upper` no longer has; parents first,
    names sorted. With no `lower`, the whole tree."""
    up_dir = upper / prefix if prefix else upper
    low_dir = (lower / prefix if prefix else lower) if lower is not None else None
    ups, lows = _listdir(up_dir), _listdir(low_dir)
    for name in sorted(ups.keys() | lows.keys()):
        rel = f"{prefix}/{name}" if prefix else name
        if name not in ups:
            yield _Entry(f"{prefix}/.wh.{name}" if prefix else f".wh.{name}", whiteout=True)
            continue
        ust, lst = ups[name], lows.get(name)
        if lst is not None and stat.S_IFMT(lst.st_mode) != stat.S_IFMT(ust.st_mode):
            lst = None  # replaced by another kind of file: the applier removes the old one
        if (
            lst is None
            or low_dir is None
            or not _unchanged(low_dir / name, lst, up_dir / name, ust)
        ):
            yield _Entry(rel)
        if stat.S_ISDIR(ust.st_mode):
            yield from tree_changes(upper, lower if lst is not None else None, rel)


def _tarinfo(tar: tarfile.TarFile, path: Path, arcname: str) -> tarfile.TarInfo:
    info = tar.gettarinfo(str(path), arcname)
    info.mtime = int(info.mtime)
    info.uname = info.gname = ""
    for name, value in _xattrs(path).items():
        info.pax_headers["SCHILY.xattr." + name] = value.decode("utf-8", "surrogateescape")
    return info


@dataclass
class Member:
    """A layer entry not taken from a tree: a file's bytes (or a file to copy), a directory
    or a symlink."""

    name: str
    kind: str  # "file", "dir" or "symlink"
    mode: int = 0o755
    data: bytes = b""
    source: Path | None = None
    target: str = ""


def write_layer(
    comment: str,
    tree: Path | None = None,
    lower: Path | None = None,
    members: Sequence[Member] = (),
) -> Layer:
    """A gzip layer blob into the cache: the changes from `lower` to `tree`, or `members`."""
    tmp = CACHE / "blobs" / f"tmp-{os.getpid()}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("wb") as raw:
        compressed = _HashingWriter(raw)
        with gzip.GzipFile(
            filename="", mode="wb", fileobj=compressed, compresslevel=GZIP_LEVEL, mtime=0
        ) as gz:
            plain = _HashingWriter(gz)
            with tarfile.open(fileobj=plain, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                if tree is not None:
                    for entry in tree_changes(tree, lower):
                        if entry.whiteout:
                            info = tarfile.TarInfo(entry.path)
                            info.mode = 0o644
                            tar.addfile(info)
                            continue
                        info = _tarinfo(tar, tree / entry.path, entry.path)
                        if info.isreg():
                            with (tree / entry.path).open("rb") as f:
                                tar.addfile(info, f)
                        else:
                            tar.addfile(info)
                for member in members:
                    _add_member(tar, member)
    digest = "sha256:" + compressed.sha256.hexdigest()
    target = blob_path(digest)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.replace(target)
    return Layer(digest, "sha256:" + plain.sha256.hexdigest(), compressed.size, comment)


def _add_member(tar: tarfile.TarFile, member: Member) -> None:
    info = tarfile.TarInfo(member.name)
    info.mode = member.mode
    if member.kind == "dir":
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    elif member.kind == "symlink":
        info.type = tarfile.SYMTYPE
        info.linkname = member.target
        tar.addfile(info)
    elif member.source is not None:
        info.size = member.source.stat().st_size
        with member.source.open("rb") as f:
            tar.addfile(info, f)
    else:
        info.size = len(member.data)
        tar.addfile(info, io.BytesIO(member.data))


# ---------------------------------------------------------------- rootfs steps


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps([RECIPE, *parts], sort_keys=True).encode()).hexdigest()[:16]


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mountpoint = line.split()[4].replace("\\040", " ")
        if mountpoint == prefix or mountpoint.startswith(prefix + "/"):
            found.append(mountpoint)
    return found


def _remove_tree(path: Path) -> None:
    """rm -rf, refused when anything is mounted below (never descend into a host mount)."""
    if not path.exists() and not path.is_symlink():
        return
    mounts = mounts_under(path)
    if mounts:
        raise ImageError(f"not removing {path}: mounts below it: {mounts}")
    shutil.rmtree(path)


def _run(argv: Sequence[str | Path], env: dict[str, str] | None = None) -> str:
    argv = [str(a) for a in argv]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-30:])
        raise ImageError(f"{shlex.join(argv)} failed ({result.returncode}):\n{tail}")
    return result.stdout


# mounts live in the command's own mount namespace, so they go when it exits
CHROOT = (
    'set -e; root=$1; shift; mkdir -p "$root/proc" "$root/dev/shm"; '
    'mount -t proc proc "$root/proc"; mount -t tmpfs -o mode=1777 shm "$root/dev/shm"; '
    'exec chroot "$root" "$@"'
)


def chroot(root: Path, *argv: str, env: dict[str, str] | None = None) -> str:
    """Run argv inside the rootfs (with /proc and /dev/shm) in a private mount namespace;
    returns its output."""
    environment = {
        "PATH": CHROOT_PATH,
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "DEBIAN_FRONTEND": "noninteractive",
        **(env or {}),
    }
    return _run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", CHROOT, "sh", root, *argv],
        env=environment,
    )


def _copy_tree(source: Path, target: Path) -> None:
    _run(["cp", "-a", "--reflink=auto", source, target])


@contextlib.contextmanager
def _apt(root: Path) -> Iterator[None]:
    """apt can fetch (the host's resolver) and no package starts a service; both undone."""
    policy = root / "usr/sbin/policy-rc.d"
    resolv = root / "etc/resolv.conf"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    resolv.unlink(missing_ok=True)
    shutil.copyfile("/etc/resolv.conf", resolv)
    try:
        yield
        chroot(root, "apt-get", "clean")
    finally:
        policy.unlink(missing_ok=True)
        resolv.unlink(missing_ok=True)
        lists = root / "var/lib/apt/lists"
        for entry in lists.iterdir() if lists.is_dir() else ():
            if entry.is_file() and entry.name != "lock":
                entry.unlink()
        _remove_tree(lists / "partial")
        (lists / "partial").mkdir(mode=0o700)
        for cache in (root / "var/cache/apt").glob("*.bin"):
            cache.unlink()


@dataclass
class Step:
    """A cached rootfs step: its tree (kept for the steps built on it) and its layers."""

    name: str
    key: str
    tree: Path | None
    layers: list[Layer]


def _step_dir(name: str, key: str) -> Path:
    return CACHE / "steps" / f"{name}-{key}"


def _load_step(name: str, key: str, keep_tree: bool) -> Step | None:
    directory = _step_dir(name, key)
    record = directory / "layers.json"
    if not record.is_file():
        return None
    layers = [Layer(**layer) for layer in json.loads(record.read_text())]
    if not all(blob_path(layer.digest).is_file() for layer in layers):
        return None
    tree = directory / "rootfs"
    if keep_tree and not tree.is_dir():
        return None
    return Step(name, key, tree if keep_tree else None, layers)


def _cached_step(
    name: str,
    key: str,
    build: Callable[[Path], list[Layer]],
    keep_tree: bool = True,
    log: Callable[[str], None] = print,
) -> Step:
    """The step from the cache, else built by build(work dir with rootfs/ for the tree) and
    kept; other keys of the same step are removed."""
    step = _load_step(name, key, keep_tree)
    if step is not None:
        return step
    log(f"building {name} ({key})")
    started = time.monotonic()
    work = CACHE / "tmp" / f"{name}-{key}"
    _remove_tree(work)
    work.mkdir(parents=True)
    try:
        layers = build(work)
        if not keep_tree:
            _remove_tree(work / "rootfs")
        (work / "layers.json").write_text(json.dumps([layer.to_json() for layer in layers]))
        final = _step_dir(name, key)
        _remove_tree(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        work.rename(final)
    finally:
        _remove_tree(work)
    for other in (CACHE / "steps").glob(f"{name}-*"):
        if other != final and re.fullmatch(rf"{re.escape(name)}-[0-9a-f]{{16}}", other.name):
            _remove_tree(other)
    log(f"built {name} in {time.monotonic() - started:.0f} s")
    return Step(name, key, final / "rootfs" if keep_tree else None, layers)


def base_step(log: Callable[[str], None] = print) -> Step:
    """Debian minbase from debootstrap, upgraded from -updates and -security."""
    key = _key("base", SUITE, MIRROR, SOURCES, platform.machine())

    def build(work: Path) -> list[Layer]:
        rootfs = work / "rootfs"
        _run(
            [
                *("unshare", "--mount", "--propagation", "private"),
                *("debootstrap", "--variant=minbase", SUITE, rootfs, MIRROR),
            ]
        )
        (rootfs / "etc/apt/sources.list").write_text(SOURCES)
        (rootfs / "etc/hostname").unlink(missing_ok=True)  # debootstrap copies the host's
        (rootfs / "var/log/bootstrap.log").unlink(missing_ok=True)
        (rootfs / "dev/shm").mkdir(exist_ok=True)
        with _apt(rootfs):
            chroot(rootfs, "apt-get", "update", "-q")
            chroot(rootfs, "apt-get", "dist-upgrade", "-y", "-q")
        return [write_layer(f"debootstrap --variant=minbase {SUITE}", rootfs)]

    return _cached_step("base", key, build, log=log)


def packages_step(
    name: str, parent: Step, packages: Sequence[str], log: Callable[[str], None] = print
) -> Step:
    """The parent's tree with `apt-get install --no-install-recommends packages`."""
    key = _key(name, parent.key, list(packages))
    lower = parent.tree
    if lower is None:
        raise ImageError(f"{parent.name} kept no tree to build {name} on")

    def build(work: Path) -> list[Layer]:
        rootfs = work / "rootfs"
        _copy_tree(lower, rootfs)
        with _apt(rootfs):
            chroot(rootfs, "apt-get", "update", "-q")
            chroot(rootfs, "apt-get", "install", "-y", "-q", "--no-install-recommends", *packages)
        return [
            *parent.layers,
            write_layer(f"apt-get install {' '.join(packages)}", rootfs, lower),
        ]

    return _cached_step(name, key, build, log=log)


# ---------------------------------------------------------------- knit


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


def wheelhouse(python: str, glibc: tuple[int, int], log: Callable[[str], None] = print) -> Path:
    """Wheels of the project's dependencies and build requirements for the image's Python,
    downloaded by this environment's pip (the image's pip installs them with no network).
    Binary wheels only: the image has no compiler."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requirements = [
        *project["build-system"]["requires"],
        "wheel",  # setuptools before 70.1 asks for it to build a wheel
        *project["project"]["dependencies"],
    ]
    machine = platform.machine()
    platforms = [f"manylinux_{glibc[0]}_{minor}_{machine}" for minor in range(glibc[1], 16, -1)]
    platforms += [f"manylinux2014_{machine}", f"manylinux2010_{machine}", f"manylinux1_{machine}"]
    key = _key("wheels", python, platforms, requirements)
    directory = CACHE / f"wheels-{key}"
    if (directory / ".complete").is_file():
        return directory
    log(f"downloading wheels for Python {python}")
    _remove_tree(directory)
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    argv += ["--only-binary=:all:", "--python-version", python, "--dest", str(directory)]
    for name in platforms:
        argv += ["--platform", name]
    _run([*argv, *requirements])
    (directory / ".complete").touch()
    for other in CACHE.glob("wheels-*"):
        if other != directory:
            _remove_tree(other)
    return directory


def knit_image(
    portmap: Path = PORTMAP, dockerfile_path: Path = DOCKERFILE, log: Callable[[str], None] = print
) -> ImageSpec:
    """knit's image as the Dockerfile describes it, on a Debian rootfs."""
    dockerfile = read_dockerfile(dockerfile_path)
    final = dockerfile.final
    builder_names = {name for name, _, _ in final.copies() if name is not None}
    if len(builder_names) != 1:
        raise ImageError(f"the final stage copies from {builder_names}, expected one builder")
    builder = dockerfile.stage(builder_names.pop())
    packages = [*KNIT_BASE_PACKAGES, *final.apt_packages()]
    if not portmap.is_file():
        raise ImageError(f"{portmap} is missing (make go-tools builds it)")

    base = base_step(log)
    system = packages_step("knit-packages", base, packages, log)
    lower = system.tree
    if lower is None:
        raise ImageError("knit-packages kept no tree")
    wheels = wheelhouse(_python_version(lower), _glibc_version(lower), log)
    context = _context_files(builder)
    inputs = [(target, _file_digest(path)) for path, target in context]
    # the builder's ENV for pip (PIP_NO_CACHE_DIR, ...); the commands name the venv's paths
    pip_env = {k: v for k, v in builder.env(BASE_ENV).items() if k.startswith("PIP_")}
    key = _key("knit", system.key, wheels.name, inputs, _file_digest(portmap), pip_env)

    def build(work: Path) -> list[Layer]:
        rootfs = work / "rootfs"
        _copy_tree(lower, rootfs)
        build_dir = rootfs / BUILD_DIR
        for path, target in context:
            (build_dir / "src" / target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, build_dir / "src" / target)
        shutil.copytree(wheels, build_dir / "wheels")
        shutil.copy2(portmap, build_dir / "portmap")
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
            "--plugin",
            f"{inside}/portmap",
        )
        _remove_tree(build_dir)
        for _, sources, destination in final.copies():
            if not (rootfs / destination.lstrip("/")).is_dir():
                raise ImageError(f"the Dockerfile copies {sources} to {destination}: not built")
        return [*system.layers, write_layer("knit: venv and cni-bundle", rootfs, lower)]

    step = _cached_step("knit", key, build, keep_tree=False, log=log)
    config: dict[str, Any] = {
        "Env": [f"{k}={v}" for k, v in final.env(BASE_ENV).items()],
        "Entrypoint": final.entrypoint(),
    }
    if final.cmd() is not None:
        config["Cmd"] = final.cmd()
    if final.user():
        config["User"] = final.user()
    if final.workdir():
        config["WorkingDir"] = final.workdir()
    return ImageSpec(KNIT_IMAGE, step.layers, config)


# ---------------------------------------------------------------- pause and agnhost


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


def pause_image(binary: Path) -> ImageSpec:
    """Upstream's pause image: /pause, run as 65535."""
    if not binary.is_file() or not static_elf(binary):
        raise ImageError(f"{binary} is not a static ELF executable")
    layer = _blob_layer(
        "pause",
        [Member("pause", "file", source=binary)],
    )
    return ImageSpec(PAUSE_IMAGE, [layer], {"Entrypoint": ["/pause"], "User": "65535:65535"})


def coredns_image(binary: Path) -> ImageSpec:
    """Cluster DNS: /coredns alone (as root, where upstream's file capability lets a non-root
    user bind port 53)."""
    if not binary.is_file() or not static_elf(binary):
        raise ImageError(f"{binary} is not a static ELF executable")
    layer = _blob_layer("coredns", [Member("coredns", "file", source=binary)])
    return ImageSpec(COREDNS_IMAGE, [layer], {"Entrypoint": ["/coredns"]})


def _blob_layer(name: str, members: list[Member]) -> Layer:
    """A layer of `members`, cached under the digests of their sources."""
    inputs = [
        (m.name, m.kind, m.mode, m.target, hashlib.sha256(m.data).hexdigest())
        + ((_file_digest(m.source),) if m.source else ())
        for m in members
    ]
    key = _key(name, inputs)
    step = _cached_step(
        name,
        key,
        lambda _work: [write_layer(name, members=members)],
        keep_tree=False,
        log=lambda _: None,
    )
    return step.layers[0]


def agnhost_image(binary: Path, log: Callable[[str], None] = print) -> ImageSpec:
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise ImageError(f"{binary} is not an executable file")
    base = base_step(log)
    system = packages_step("agnhost-packages", base, AGNHOST_PACKAGES, log)
    layer = _blob_layer(
        "agnhost",
        [
            Member("agnhost", "file", source=binary),
            Member("agnhost-2", "symlink", target="agnhost"),
            Member("uploads", "dir"),
            Member("usr/local/bin/agnhost", "symlink", target="/agnhost"),
        ],
    )
    config = {
        "Env": [f"{k}={v}" for k, v in BASE_ENV.items()],
        "Entrypoint": ["/agnhost"],
        "Cmd": ["pause"],
        "ExposedPorts": {f"{port}/tcp": {} for port in AGNHOST_PORTS},
    }
    return ImageSpec(AGNHOST_IMAGE, [*system.layers, layer], config)


def glibc_dns_testing_image(log: Callable[[str], None] = print) -> ImageSpec:
    """The e2e DNS specs' glibc querier: a shell script of dig and getent over glibc's
    resolver, which agnhost's Debian rootfs holds (dnsutils, libc-bin)."""
    system = packages_step("agnhost-packages", base_step(log), AGNHOST_PACKAGES, log)
    config = {"Env": [f"{k}={v}" for k, v in BASE_ENV.items()], "Cmd": ["/bin/sh"]}
    return ImageSpec(GLIBC_DNS_TESTING_IMAGE, list(system.layers), config)


# ---------------------------------------------------------------- OCI layout


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _descriptor(media_type: str, data: bytes) -> dict[str, Any]:
    return {
        "mediaType": media_type,
        "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
        "size": len(data),
    }


def oci_documents(image: ImageSpec) -> tuple[bytes, bytes, bytes]:
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


def read_index(archive: Path) -> dict[str, Any] | None:
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


def write_archive(image: ImageSpec, path: Path) -> bool:
    """The image as an OCI image layout tar at `path`; False when `path` already is it."""
    config, manifest, index = oci_documents(image)
    if read_index(path) == json.loads(index):
        return False
    tmp = path.with_name(f".{path.name}.tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, data: bytes | None = None, source: Path | None = None) -> None:
            info = tarfile.TarInfo(name)
            if data is None and source is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif source is not None:
                info.size, info.mode = source.stat().st_size, 0o644
                with source.open("rb") as f:
                    tar.addfile(info, f)
            else:
                assert data is not None
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))

        add("oci-layout", _json({"imageLayoutVersion": "1.0.0"}))
        add("index.json", index)
        add("blobs")
        add("blobs/sha256")
        blobs = {json.loads(index)["manifests"][0]["digest"]: manifest}
        blobs[json.loads(manifest)["config"]["digest"]] = config
        for digest, data in sorted(blobs.items()):
            add("blobs/" + digest.replace(":", "/"), data)
        for digest in sorted({layer.digest for layer in image.layers}):
            add("blobs/" + digest.replace(":", "/"), source=blob_path(digest))
    tmp.replace(path)
    return True


def image_names(archive: Path) -> list[str]:
    index = read_index(archive)
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


# ---------------------------------------------------------------- the build


def _prune_blobs() -> None:
    """Drop the blobs no cached step refers to."""
    wanted = set()
    for record in (CACHE / "steps").glob("*/layers.json"):
        wanted.update(layer["digest"] for layer in json.loads(record.read_text()))
    for blob in (CACHE / "blobs" / "sha256").glob("*"):
        if f"sha256:{blob.name}" not in wanted:
            blob.unlink()


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build(
    output: Path,
    pause: Path | None = None,
    agnhost: Path | None = None,
    portmap: Path = PORTMAP,
    log: Callable[[str], None] = print,
    coredns: Path | None = None,
) -> dict[str, Path]:
    """Build knit's image (and pause's, agnhost's and CoreDNS's when their binaries are given)
    into output/{knit,pause,agnhost,coredns}.tar; returns image name -> archive."""
    if os.geteuid() != 0:
        raise ImageError("building the images needs root (debootstrap, chroot)")
    output.mkdir(parents=True, exist_ok=True)
    archives = {}
    with _locked():
        specs = [("knit", knit_image(portmap, log=log))]
        if pause is not None:
            specs.append(("pause", pause_image(pause)))
        if agnhost is not None:
            specs.append(("agnhost", agnhost_image(agnhost, log)))
            specs.append(("glibc-dns-testing", glibc_dns_testing_image(log)))
        if coredns is not None:
            specs.append(("coredns", coredns_image(coredns)))
        for filename, spec in specs:
            path = output / f"{filename}.tar"
            write_archive(spec, path)
            archives[spec.name] = path
        _prune_blobs()
    return archives


def build_lab_images(output: Path) -> dict[str, Path]:
    """Every image the lab's cluster runs, from the binaries `make go-tools` built."""
    return build(output, PAUSE_BINARY, AGNHOST_BINARY, coredns=COREDNS_BINARY)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.lab.image", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="build the image archives")
    build_parser.add_argument("--output", type=Path, required=True)
    build_parser.add_argument(
        "--pause", type=Path, help=f"static pause binary (default {PAUSE_BINARY}, if there)"
    )
    build_parser.add_argument(
        "--agnhost", type=Path, help=f"agnhost binary (default {AGNHOST_BINARY}, if there)"
    )
    args = parser.parse_args(argv)

    def given_or_default(given: Path | None, default: Path, what: str) -> Path | None:
        if given is not None:
            return given
        if default.is_file():
            return default
        print(f"{what}: no {default}, not built (pass --{what})", file=sys.stderr)
        return None

    pause = given_or_default(args.pause, PAUSE_BINARY, "pause")
    agnhost = given_or_default(args.agnhost, AGNHOST_BINARY, "agnhost")
    started = time.monotonic()
    try:
        archives = build(args.output, pause, agnhost)
    except ImageError as err:
        sys.exit(f"image: {err}")
    for name, path in archives.items():
        print(f"{name}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    print(f"done in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
