"""The plugin as a CNI_PATH directory running this checkout on this interpreter: `knit`, the
compiled client (cni/client.c; copied from --client when given, `make cni` compiles it in
place), and beside it knit.d/launch, its settings, and knit.d/knit-in-process, the Python
plugin it execs for in-process calls. That launcher skips site processing (-S) and names its
import paths itself: measured, ~3-6 ms less per call.

`make cni` writes build/cni with it; a VM node, whose interpreter is not the host's, writes its
own directory with it from the same checkout.

    python -m deploy.lab.plugin_dir --output DIR [--client PATH] [--socket PATH]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IN_PROCESS = "knit.d/knit-in-process"


def launcher_text() -> str:
    """The in-process plugin's script for this interpreter and checkout."""
    paths = [str(ROOT), sysconfig.get_paths()["purelib"]]
    return (
        f"#!{sys.executable} -IS\n"
        "import sys\n"
        f"sys.path[:0] = {paths!r}\n"
        "from cni.in_process import main\n"
        "main()\n"
    )


def write(output: Path, client: Path | None = None, socket_path: str = "") -> None:
    """DIR/knit.d's two files, and DIR/knit copied from client when one is given."""
    (output / "knit.d").mkdir(parents=True, exist_ok=True)
    if client is not None:
        shutil.copy2(client, output / "knit")
    launcher = output / IN_PROCESS
    launcher.write_text(launcher_text())
    launcher.chmod(0o755)
    launch = output / "knit.d/launch"
    staged = launch.with_suffix(".tmp")
    staged.write_text(f"plugin={IN_PROCESS}\nsocket={socket_path}\n")
    staged.replace(launch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--client", type=Path, help="the compiled client to copy in")
    parser.add_argument("--socket", default="", help="a daemon's socket for the client's calls")
    options = parser.parse_args()
    write(options.output, options.client, options.socket)


if __name__ == "__main__":
    main()
