"""The layering the project keeps: the product never imports its test worlds, nothing
outside tests/ imports from tests/ (deploy/lab builds every world the tests and benches use),
and test modules share only tests/support."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from deploy.lab.paths import ROOT

OUTSIDE_TESTS = ("cni", "proxyd", "deploy", "bench")


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def sources(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def test_nothing_outside_tests_imports_tests() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            m for m in imported_modules(path) if m.split(".")[0] == "tests"
        )
        for path in sources(*OUTSIDE_TESTS)
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}


def test_the_product_does_not_import_the_lab_or_the_benches() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            m for m in imported_modules(path) if m.split(".")[0] in ("deploy", "bench", "tests")
        )
        for path in sources("cni", "proxyd")
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}


def imported_from_tests(path: Path) -> set[str]:
    """The modules of tests/ that path imports (`from tests.unit import test_x` names the
    module tests.unit.test_x)."""
    found: set[str] = set()
    for module in imported_modules(path):
        if module.split(".")[0] != "tests":
            continue
        if not (ROOT / module.replace(".", "/")).is_dir():
            found.add(module)
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == module and node.level == 0:
                found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_test_modules_share_only_tests_support() -> None:
    """What tests share (doubles, world helpers, strategies) lives in tests.support: no module
    under tests/ imports a test module, and a test module imports nothing else of tests/."""
    offenders = {}
    for path in sources("tests"):
        test_module = path.name.startswith("test_")
        offenders[str(path.relative_to(ROOT))] = sorted(
            module
            for module in imported_from_tests(path)
            if module.split(".")[-1].startswith("test_")
            or (test_module and not (module + ".").startswith("tests.support."))
        )
    assert {path: mods for path, mods in offenders.items() if mods} == {}


LEFT_COLD = {
    "cni.ipam.delegate": "a delegated call starts a plugin process, which costs far more",
}
"""Modules a verb imports lazily that the fast path's warm-up leaves, and why."""


def lazily_imported(folder: str) -> set[str]:
    """The modules of `folder`'s package imported inside a function (`from cni import masq`
    names the module cni.masq)."""
    found: set[str] = set()
    for path in sources(folder):
        for function in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    package = (ROOT / node.module.replace(".", "/")).is_dir()
                    if package:
                        found.update(f"{node.module}.{alias.name}" for alias in node.names)
                    else:
                        found.add(node.module)
    return {module for module in found if module.split(".")[0] == folder}


def test_the_fast_path_warms_every_module_a_verb_imports_lazily() -> None:
    """The daemon imports at start what the plugin's verbs import on first use
    (cni.server.LAZY_MODULES), so that no call pays for it: that list is checked here, not
    kept in step by hand."""
    warmed = subprocess.run(
        [sys.executable, "-c",
         "import sys, cni.server as s; s._warm_up(); print(' '.join(sorted(sys.modules)))"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    cold = lazily_imported("cni") - set(warmed) - LEFT_COLD.keys()
    assert cold == set()


def test_the_kernel_layer_imports_nothing_else_of_knit() -> None:
    """cni/kernel is shared by the plugin and the daemon: it may not reach back into either."""
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            module
            for module in imported_modules(path)
            if module.split(".")[0] in ("cni", "proxyd") and not module.startswith("cni.kernel")
        )
        for path in sources("cni/kernel")
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}
