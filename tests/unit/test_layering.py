"""The layering the project keeps: the product never imports its test worlds, and nothing
outside tests/ imports from tests/ (deploy/lab builds every world the tests and benches use)."""

from __future__ import annotations

import ast
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
