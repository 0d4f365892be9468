"""The command line, `python -m deploy.lab.image build --output DIR [--pause BIN]
[--agnhost BIN]`: the images into DIR, pause's and agnhost's from the given binaries or, when
not given, from where the other builds put them (skipped when they are not there either).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from deploy.lab import image
from deploy.lab.image.errors import ImageError
from deploy.lab.image.recipes import AGNHOST_BINARY, PAUSE_BINARY, build


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.lab.image", description=image.__doc__)
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
