"""The `knit` executable's entry: hand ADD, CHECK and DEL to the node daemon when it runs.

A call served by the daemon (cni.server) never imports the plugin, so this module imports
only C modules the interpreter has loaded or builds in: posix rather than os (1.2 ms), no json,
no socket.py, no cni.* (those would cost more than the Go reference plugin takes for a call).
Only when the daemon cannot answer does it import cni.plugin, to print the error as the plugin
would, in the call's cniVersion.

Wire format, one call per connection (lengths are 4-byte big-endian):
  request:  version byte, sent alone with the descriptor of CNI_NETNS as SCM_RIGHTS ancillary
            data (none when CNI_NETNS is empty), len + environment ("KEY=VALUE" joined by NUL:
            the CNI_* variables), len + stdin
  response: version byte, exit code byte, len + stdout
Each side checks the other's version byte first, so a plugin and a daemon of different
protocol versions answer with a clear error instead of misreading each other. The exit code
DECLINED says the daemon did not run the call (over its limits, see cni.server): the plugin
runs it in-process, as without a daemon; its stdout is an error JSON for plugins before it.

The plugin opens CNI_NETNS itself because the daemon lives in mount and PID namespaces of its
own, where the runtime's path (/proc/<pid>/ns/net, a bind mount under the runtime's state
directory) may name nothing or something else. When the plugin cannot open it, the call runs
here and reports that as it would without a daemon.
"""

import _socket
import posix
import sys

PROTOCOL = 2
FORWARDED = frozenset({b"ADD", b"CHECK", b"DEL"})
ENV_PREFIX = b"CNI_"
LENGTH_BYTES = 4
HEADER_BYTES = 2 + LENGTH_BYTES
DECLINED = 255  # never an exit code of cni.plugin.execute (0 or 1)


def main(socket_path: str | None) -> None:
    _drop_ld_library_path()
    if socket_path and posix.environ.get(b"CNI_COMMAND") in FORWARDED:
        try:
            netns_fd = open_netns()
        except OSError:
            pass  # the call runs here, and names the namespace it cannot open either
        else:
            _forward(socket_path, netns_fd)
    from cni.plugin import main as in_process

    in_process()


def open_netns() -> int | None:
    """A descriptor of CNI_NETNS for the daemon; None when the call names no namespace."""
    path = posix.environ.get(b"CNI_NETNS")
    # O_NONBLOCK: a FIFO placed at CNI_NETNS must not hold the call (see netns.open_netns)
    flags = posix.O_RDONLY | posix.O_CLOEXEC | posix.O_NONBLOCK
    return posix.open(path, flags) if path else None


def _forward(socket_path: str, netns_fd: int | None) -> None:
    """Print the daemon's answer and exit; return when no daemon listens or it declines the
    call, for the call to run here."""
    connection = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        connection.connect(socket_path)
    except (FileNotFoundError, ConnectionRefusedError):
        connection.close()
        if netns_fd is not None:
            posix.close(netns_fd)
        return
    except OSError as err:
        connection.close()
        reason = f"cannot reach the knit daemon at {socket_path}: {err}"
        _finish(1, _error(reason, _read_all(0)))
    stdin = _read_all(0)
    code, output = _exchange(connection, netns_fd, stdin)
    if code != DECLINED:
        _finish(code, output)
    if netns_fd is not None:
        posix.close(netns_fd)
    import io  # loaded at start-up: sys.stdin is one

    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))  # what cni.plugin.main reads the call from


def _drop_ld_library_path() -> None:
    """A bundled runtime sets LD_LIBRARY_PATH for the interpreter alone: iptables and a
    delegated IPAM plugin must not inherit it."""
    posix.unsetenv(b"LD_LIBRARY_PATH")
    posix.environ.pop(b"LD_LIBRARY_PATH", None)  # os.environ is built from it on import
    if "os" in sys.modules:  # a launcher that imported os before calling main
        sys.modules["os"].environ.pop("LD_LIBRARY_PATH", None)


def forwarded_environment() -> bytes:
    return b"\0".join(k + b"=" + v for k, v in posix.environ.items() if k.startswith(ENV_PREFIX))


def encode_request(env: bytes, stdin: bytes) -> bytes:
    return b"".join((bytes((PROTOCOL,)), _length(env), env, _length(stdin), stdin))


def _exchange(connection: _socket.socket, netns_fd: int | None, stdin: bytes) -> tuple[int, bytes]:
    """Send the call and wait for its answer; never redo it here once the daemon has it (a
    DECLINED answer says it has not: the daemon declines only calls it has not read whole)."""
    send_request(connection, encode_request(forwarded_environment(), stdin), netns_fd)
    answer = _receive_all(connection)
    connection.close()
    return decode_response(answer, stdin)


def send_request(connection: _socket.socket, request: bytes, netns_fd: int | None) -> None:
    """The version byte alone carries the descriptor, so the daemon finds it on its first read."""
    try:
        connection.sendmsg([request[:1]], _rights(netns_fd))
        connection.sendall(request[1:])
        connection.shutdown(_socket.SHUT_WR)
    except OSError:
        return  # the daemon left: what it answered before, if anything, is still readable


def _rights(netns_fd: int | None) -> list[tuple[int, int, bytes]]:
    """The descriptor as SCM_RIGHTS carries it, a C int (array would cost an import)."""
    if netns_fd is None:
        return []
    return [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, netns_fd.to_bytes(4, sys.byteorder))]


def decode_response(answer: bytes, stdin: bytes) -> tuple[int, bytes]:
    """(exit code, output) from the daemon's answer to the call whose stdin was sent."""
    if answer and answer[0] != PROTOCOL:
        return 1, _error(
            f"the knit daemon speaks protocol {answer[0]}, this plugin speaks {PROTOCOL}",
            stdin,
        )
    size = int.from_bytes(answer[2:HEADER_BYTES], "big")
    if len(answer) < HEADER_BYTES or len(answer) != HEADER_BYTES + size:
        return 1, _error("the knit daemon closed the connection before answering", stdin)
    return answer[1], answer[HEADER_BYTES:]


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := posix.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _receive_all(connection: _socket.socket) -> bytes:
    data = b""
    while chunk := _receive(connection):
        data += chunk
    return data


def _receive(connection: _socket.socket) -> bytes:
    try:
        return connection.recv(1 << 16)
    except OSError:
        return b""  # a reset ends the answer too: decode_response checks that it is whole


def _length(data: bytes) -> bytes:
    return len(data).to_bytes(LENGTH_BYTES, "big")


def _error(msg: str, stdin: bytes) -> bytes:
    """Error 199 as cni.plugin prints it for this call: only an error pays for the import."""
    from cni.errors import CniError, Code
    from cni.plugin import error_output

    return error_output(CniError(Code.UNEXPECTED, msg), stdin)


def _finish(code: int, output: bytes) -> None:
    """Print the answer and leave at once: the interpreter's finalization would cost more
    (~2.5 ms) than the rest of this module, and there is nothing to flush or clean."""
    while output:
        output = output[posix.write(1, output) :]
    posix._exit(code)
