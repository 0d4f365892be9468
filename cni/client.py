"""The `knit` executable's entry: hand ADD, CHECK and DEL to the node daemon when it runs.

A call served by the daemon (cni.server) never imports the plugin, so this module imports
only C modules the interpreter has loaded or builds in: posix rather than os (1.2 ms), no json,
no socket.py, no cni.* (those would cost more than the Go reference plugin takes for a call).
Only when the daemon cannot answer does it import cni.plugin, to print the error as the plugin
would, in the call's cniVersion.

Wire format, one call per connection (lengths are 4-byte big-endian):
  request:  version byte, len + environment ("KEY=VALUE" joined by NUL: the CNI_* variables),
            len + stdin
  response: version byte, exit code byte, len + stdout
Each side checks the other's version byte first, so a plugin and a daemon of different
protocol versions answer with a clear error instead of misreading each other.
"""

import _socket
import posix
import sys

PROTOCOL = 1
FORWARDED = frozenset({b"ADD", b"CHECK", b"DEL"})
ENV_PREFIX = b"CNI_"
LENGTH_BYTES = 4
HEADER_BYTES = 2 + LENGTH_BYTES


def main(socket_path: str | None) -> None:
    _drop_ld_library_path()
    if socket_path and posix.environ.get(b"CNI_COMMAND") in FORWARDED:
        connection = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            connection.connect(socket_path)
        except (FileNotFoundError, ConnectionRefusedError):
            connection.close()  # no daemon: the call runs here
        except OSError as err:
            connection.close()
            reason = f"cannot reach the knit daemon at {socket_path}: {err}"
            _finish(1, _error(reason, _read_all(0)))
        else:
            _finish(*_exchange(connection))
    from cni.plugin import main as in_process

    in_process()


def _drop_ld_library_path() -> None:
    """A bundled runtime sets LD_LIBRARY_PATH for the interpreter alone: iptables, nft and a
    delegated IPAM plugin must not inherit it."""
    posix.unsetenv(b"LD_LIBRARY_PATH")
    posix.environ.pop(b"LD_LIBRARY_PATH", None)  # os.environ is built from it on import
    if "os" in sys.modules:  # a launcher that imported os before calling main
        sys.modules["os"].environ.pop("LD_LIBRARY_PATH", None)


def forwarded_environment() -> bytes:
    return b"\0".join(k + b"=" + v for k, v in posix.environ.items() if k.startswith(ENV_PREFIX))


def encode_request(env: bytes, stdin: bytes) -> bytes:
    return b"".join((bytes((PROTOCOL,)), _length(env), env, _length(stdin), stdin))


def _exchange(connection: _socket.socket) -> tuple[int, bytes]:
    """Send the call and wait for its answer; never redo it here once the daemon has it."""
    stdin = _read_all(0)
    _send(connection, encode_request(forwarded_environment(), stdin))
    answer = _receive_all(connection)
    connection.close()
    return decode_response(answer, stdin)


def _send(connection: _socket.socket, request: bytes) -> None:
    try:
        connection.sendall(request)
        connection.shutdown(_socket.SHUT_WR)
    except OSError:
        return  # the daemon left: what it answered before, if anything, is still readable


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
