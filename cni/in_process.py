"""The Python plugin's entry: what the executable `knit` (cni/client.c) execs when a call runs
in-process, that is every call the node daemon does not serve (VERSION, STATUS, GC, any call
without a daemon or that it declined) and every fast-path failure, for its error JSON.

The executable hands a failure over as a message in KNIT_FAST_PATH_ERROR with the call's
stdin, so the error is printed as the plugin prints any, in the call's cniVersion.
"""

import os
import sys

ERROR_VARIABLE = "KNIT_FAST_PATH_ERROR"


def main() -> None:
    # The bundle's launcher sets LD_LIBRARY_PATH for the interpreter alone, and the error
    # message is for this process alone: iptables and a delegated IPAM plugin inherit neither.
    os.environ.pop("LD_LIBRARY_PATH", None)
    error = os.environ.pop(ERROR_VARIABLE, None)
    if error is None:
        from cni.plugin import main as in_process

        in_process()
        return
    from cni.errors import CniError, Code
    from cni.plugin import error_output

    sys.stdout.buffer.write(error_output(CniError(Code.UNEXPECTED, error), sys.stdin.buffer.read()))
    sys.stdout.flush()
    sys.exit(1)
