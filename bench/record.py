"""A bench run's dated result file: every figure it printed, with its command, commit and
machine, written by the bench itself into docs/results/ (or where `--json` says), so that the
figures docs/benchmarks.md quotes have one home and a new run changes one file."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deploy.lab.paths import ROOT

RESULTS = ROOT / "docs" / "results"
REVISION_VARIABLE = "KNIT_REVISION"


def revision() -> str:
    """The checkout's commit, marked -dirty when the tree has changes; REVISION_VARIABLE's
    value when set (a VM node, which has no git, is given the host's)."""
    if given := os.environ.get(REVISION_VARIABLE):
        return given
    return subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        type=Path,
        help="write the figures here (default docs/results/<date>-<bench>[-<variant>].json)",
    )


def result_path(chosen: Path | None, bench: str, variant: str = "") -> Path:
    """Where a run's file goes: the chosen path, or today's file of this bench and variant."""
    if chosen is not None:
        return chosen
    name = "-".join(part for part in (time.strftime("%Y-%m-%d"), bench, variant) if part)
    return RESULTS / f"{name}.json"


def nft_version() -> str:
    found = subprocess.run(["nft", "--version"], capture_output=True, text=True, check=False)
    return found.stdout.strip()


def write(path: Path, figures: list[dict[str, Any]], began_at: str, **extra: Any) -> None:
    """Write the run's figures with what produced them; `began_at` is the commit at the run's
    start (a tree changed during the run is recorded as such). `extra` adds keys of the
    bench's own (a series of samples, say) after the figures."""
    record = {
        "command": shlex.join(["python", "-m", *_module_and_arguments()]),
        "commit": began_at,
        "commit_at_end": revision(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "nft": nft_version(),
        },
        "figures": figures,
        **extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"figures written to {path}")


def _module_and_arguments() -> list[str]:
    main = sys.modules["__main__"]
    module = main.__spec__.name if main.__spec__ is not None else sys.argv[0]
    return [module, *sys.argv[1:]]
