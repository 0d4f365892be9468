"""Build a relocatable runtime for the CNI plugin from the running interpreter.

kind node images do not promise a python3, so the DaemonSet's image carries this tree and the
node daemon installs it next to the `knit` launcher (`cni.install`). Layout:

    bin/knit               the compiled client the runtime starts (cni/client.c): it hands
                           calls to the node daemon, and the rest to bin/knit-in-process
    bin/knit-in-process    a sh launcher running knit.py on the interpreter beside it
    bin/python3.X          the real interpreter binary
    knit.py                the Python plugin's entry (cni.in_process)
    lib/python3.X/         its standard library, pruned, with lib-dynload/
    lib/*.so*              the shared libraries the binary and the extension modules link
                           (libpython when the binary links it dynamically), except glibc's own
    site/                  the cni package (standard library only: it speaks netlink itself)
    plugins/               extra executables installed beside `knit` (the reference portmap)
    manifest.json          the version (a content hash) and what install needs to know

Python computes its prefix from the binary's location through the landmark lib/python3.X/os.py,
so the tree works wherever it is copied. Every module is precompiled with unchecked-hash .pyc
files: they do not depend on file times, so a copy never makes a call recompile.

    python -m cni.bundle --output DIR --client PATH [--plugin PATH ...]
"""

from __future__ import annotations

import argparse
import compileall
import hashlib
import json
import os
import platform
import py_compile
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import cni

MANIFEST = "manifest.json"
SITE = "site"
CLIENT = "bin/knit"
IN_PROCESS = "bin/knit-in-process"
ENTRY = "knit.py"
PLUGINS = "plugins"
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"

# Parts of the standard library the plugin never uses: tests, GUIs, interactive tools,
# installers, dbm and NIS, the static libpython and Makefile (config-*), and the base's own
# packages. Dropping an extension module also drops the libraries only it links (readline,
# ncurses, gdbm, libnsl, Kerberos and SQLite).
PRUNED_STDLIB = {
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "turtle.py",
    "ensurepip",
    "lib2to3",
    "pydoc_data",
    "curses",
    "sqlite3",
    "site-packages",
    "dist-packages",
    "lib-dynload",  # copied on its own, pruned below
    "__pycache__",
}
PRUNED_STDLIB_PREFIXES = ("config-",)
PRUNED_EXTENSIONS = re.compile(
    r"^(_test|_ctypes_test|_xxtestfuzz|xxlimited|_tkinter|_curses|readline"
    r"|_dbm|_gdbm|nis|_sqlite3)[._]"
)
# glibc's libraries must come from the node (they go with its ld.so); everything else the
# binary or an extension module links travels with the tree.
GLIBC = re.compile(
    r"^(ld-linux.*|linux-vdso|linux-gate|"
    r"lib(c|m|pthread|dl|rt|util|resolv|anl|mvec|BrokenLocale|thread_db|nss_\w+))\.so(\.|$)"
)
LDD_LINE = re.compile(r"^\s*(\S+)\s+=>\s+(\S+)\s+\(0x[0-9a-f]+\)$")


class BundleError(Exception):
    pass


def interpreter() -> Path:
    """The real binary behind this interpreter (through a venv and any symlinks)."""
    return Path(getattr(sys, "_base_executable", "") or sys.executable).resolve()


def stdlib_dir() -> Path:
    return Path(sysconfig.get_path("stdlib")).resolve()


def dynload_dir() -> Path:
    for entry in sys.path:
        if Path(entry).name == "lib-dynload":
            return Path(entry).resolve()
    raise BundleError("this interpreter has no lib-dynload directory on sys.path")


def _ignore_caches(_directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n == "__pycache__" or n.endswith(".pyc")}


def copy_stdlib(tree: Path) -> None:
    source, target = stdlib_dir(), tree / "lib" / PYVER

    def ignore(directory: str, names: list[str]) -> set[str]:
        if Path(directory) != source:
            return _ignore_caches(directory, names)
        return {n for n in names if n in PRUNED_STDLIB or n.startswith(PRUNED_STDLIB_PREFIXES)}

    shutil.copytree(source, target, ignore=ignore)
    dynload = target / "lib-dynload"
    dynload.mkdir()
    for module in sorted(dynload_dir().iterdir()):
        if module.is_file() and not PRUNED_EXTENSIONS.match(module.name):
            shutil.copy2(module, dynload / module.name)


def copy_package(tree: Path) -> None:
    """The cni package into site/."""
    shutil.copytree(Path(cni.__file__).parent, tree / SITE / "cni", ignore=_ignore_caches)


def linked_libraries(binary: Path) -> dict[str, Path]:
    """soname -> file for what `ldd` says the binary loads, glibc's own left out."""
    result = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False)
    if "not a dynamic executable" in result.stdout + result.stderr:
        return {}
    if result.returncode != 0:
        raise BundleError(f"ldd {binary} failed: {result.stderr.strip()}")
    libraries = {}
    for line in result.stdout.splitlines():
        if "=> not found" in line:
            raise BundleError(f"{binary} needs a library that is missing here: {line.strip()}")
        match = LDD_LINE.match(line)
        if match and not GLIBC.match(match[1]):
            libraries[match[1]] = Path(match[2]).resolve()
    return libraries


def copy_libraries(tree: Path) -> None:
    binaries = [tree / "bin" / PYVER, *sorted(tree.rglob("*.so"))]
    libraries: dict[str, Path] = {}
    for binary in binaries:
        libraries.update(linked_libraries(binary))
    for soname, source in sorted(libraries.items()):
        shutil.copy2(source, tree / "lib" / soname)


def strip_binaries(tree: Path) -> None:
    """Drop debug symbols (a pyenv build carries them, and every node would receive them)
    when binutils is here; the dynamic symbol table, which extension modules link against,
    stays."""
    strip = shutil.which("strip")
    if strip is not None:
        binaries = [tree / "bin" / PYVER, *sorted((tree / "lib").rglob("*.so*"))]
        subprocess.run([strip, "--strip-unneeded", *map(str, binaries)], check=True)


def compile_tree(tree: Path) -> None:
    for directory in (tree / "lib" / PYVER, tree / SITE):
        ok = compileall.compile_dir(
            directory,
            quiet=1,
            workers=0,
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )
        if not ok:
            raise BundleError(f"some modules under {directory} do not compile")


# Run by the bundled interpreter: every module of the cni package imports from
# inside the tree, and nothing comes from outside it.
SMOKE_CHECK = """
import pkgutil, sys
tree = sys.argv[1]
sys.path.append(tree + "/site")
import cni
for module in pkgutil.walk_packages(cni.__path__, "cni."):
    if not module.name.endswith(".__main__"):
        __import__(module.name)
outside = sorted(
    name for name, module in sys.modules.items()
    if getattr(module, "__file__", None) and not module.__file__.startswith(tree + "/")
)
if outside or not sys.prefix == sys.exec_prefix == tree:
    sys.exit(f"prefix {sys.prefix}, modules from outside the tree: {outside}")
"""


def smoke_check(tree: Path) -> None:
    """Import the plugin's modules with the bundled interpreter, isolated from this one."""
    root = tree.resolve()
    result = subprocess.run(
        [str(root / "bin" / PYVER), "-I", "-S", "-c", SMOKE_CHECK, str(root)],
        env={"LD_LIBRARY_PATH": str(root / "lib")},
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise BundleError(f"the bundled interpreter cannot import the plugin: {result.stderr}")


def write_entry(tree: Path, client: Path) -> None:
    """The client, and what it execs for a call it does not hand to the daemon."""
    shutil.copy2(client, tree / CLIENT)
    (tree / ENTRY).write_text(
        "import sys\n"
        f"sys.path.append(__file__.rpartition('/')[0] + {'/' + SITE!r})\n"
        "from cni.in_process import main\n"
        "main()\n"
    )
    in_process = tree / IN_PROCESS
    in_process.write_text(
        "#!/bin/sh\n"
        "# knit's Python plugin on the bundled runtime, for the calls bin/knit runs in-process.\n"
        'd="${0%/*}/.."\n'
        'export LD_LIBRARY_PATH="$d/lib"\n'
        f'exec "$d/bin/{PYVER}" -I -S "$d/{ENTRY}" "$@"\n'
    )
    in_process.chmod(0o755)


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _runtime_files(tree: Path) -> list[Path]:
    """What the version covers: everything but the manifest, the plugins and the .pyc files,
    which the sources and the interpreter determine (marshal output is not reproducible)."""
    return sorted(
        path
        for path in tree.rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and path.relative_to(tree).parts[0] not in (MANIFEST, PLUGINS)
    )


def seal(tree: Path) -> dict[str, Any]:
    """Compute the tree's version and write its manifest; returns the manifest."""
    site = tree / SITE
    digest = hashlib.sha256()
    for path in _runtime_files(tree):
        mode = "x" if os.access(path, os.X_OK) else "-"
        digest.update(f"{path.relative_to(tree)}\0{mode}\0{_file_digest(path)}\n".encode())
    plugins_dir = tree / PLUGINS
    plugins = (
        {p.name: _file_digest(p) for p in sorted(plugins_dir.iterdir())}
        if plugins_dir.is_dir()
        else {}
    )
    manifest = {
        "version": digest.hexdigest()[:16],
        "python": platform.python_version(),
        "interpreter": f"bin/{PYVER}",
        "client": CLIENT,
        "in_process": IN_PROCESS,
        "site": SITE,
        "packages": sorted(p.name.removesuffix(".dist-info") for p in site.glob("*.dist-info")),
        "plugins": plugins,
        "size": sum(p.stat().st_size for p in tree.rglob("*") if p.is_file()),
    }
    (tree / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(tree: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((tree / MANIFEST).read_text())
    return manifest


def build(output: Path, client: Path, plugins: Iterable[Path] = ()) -> dict[str, Any]:
    """Build the tree into `output` (absent or empty) around the compiled client; returns its
    manifest."""
    if output.exists() and any(output.iterdir()):
        raise BundleError(f"{output} is not empty")
    plugin_list = list(plugins)
    for executable in [client, *plugin_list]:
        if not executable.is_file() or not os.access(executable, os.X_OK):
            raise BundleError(f"{executable} is not an executable file")
    (output / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(interpreter(), output / "bin" / PYVER)
    copy_stdlib(output)
    copy_package(output)
    copy_libraries(output)
    strip_binaries(output)
    compile_tree(output)
    smoke_check(output)
    write_entry(output, client)
    if plugin_list:
        (output / PLUGINS).mkdir()
        for plugin in plugin_list:
            shutil.copy2(plugin, output / PLUGINS / plugin.name)
    return seal(output)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m cni.bundle", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--output", type=Path, required=True, help="directory to build into")
    parser.add_argument(
        "--client", type=Path, required=True, help="the compiled client (make cni: build/cni/knit)"
    )
    parser.add_argument(
        "--plugin",
        type=Path,
        action="append",
        default=[],
        help="an executable to install beside knit (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        manifest = build(args.output, args.client, args.plugin)
    except BundleError as err:
        sys.exit(f"cni.bundle: {err}")
    print(
        f"{args.output}: version {manifest['version']}, Python {manifest['python']}, "
        f"{', '.join(manifest['packages'])}, {manifest['size'] / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
