"""``plain streams``: what ordinary TCP sockets carry over a link, the limit of ``bench --link``.

A server (in the target's namespace) and a client (in the initiator's) open ``streams`` plain TCP
connections with the kernel's default options and move ``bytes`` over them, split evenly, in
the direction of the op: ``write`` from client to server, ``read`` from server to client.  The
client times from its first byte sent (or request) to the moment the last byte has been received
(a write's receiver answers one byte per stream once its share has arrived), so the figure is
what crossed the link, not what sat in socket buffers.

Both sides are processes of their own (``python -m flagcx_mc.tools.bench.plain_streams``), like
the engines' workers, so neither shares a GIL with the bench.  Each connection's thread moves
1 MiB per system call; the payload is whatever the buffer holds.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import subprocess
import sys
import threading
import time

__all__ = ["main"]

_CHUNK = 1 << 20
_HEADER = struct.Struct("<cQ")  # op (b"w" / b"r"), bytes on this connection


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("connection closed")
        data += got
    return bytes(data)


def _drain(sock: socket.socket, n: int, buf: memoryview) -> None:
    while n > 0:
        got = sock.recv_into(buf[:min(n, len(buf))])
        if not got:
            raise ConnectionError("connection closed mid-stream")
        n -= got


def _pour(sock: socket.socket, n: int, buf: memoryview) -> None:
    while n > 0:
        step = min(n, len(buf))
        sock.sendall(buf[:step])
        n -= step


def _serve_one(conn: socket.socket) -> None:
    buf = memoryview(bytearray(_CHUNK))
    with conn:
        try:
            while True:
                op, n = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
                if op == b"w":
                    _drain(conn, n, buf)
                    conn.sendall(b"k")
                else:
                    _pour(conn, n, buf)
        except (ConnectionError, OSError):
            return


def serve(host: str, port: int) -> None:
    """Accept connections forever, each served by a thread; prints ``{"port": P}`` once listening."""
    lsock = socket.create_server((host, port), backlog=64)
    print(json.dumps({"port": lsock.getsockname()[1]}), flush=True)
    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


def _one_stream(conn: socket.socket, n: int, op: str, start: threading.Barrier, errors: list[BaseException]) -> None:
    buf = memoryview(bytearray(_CHUNK))
    try:
        start.wait()
        conn.sendall(_HEADER.pack(op[:1].encode(), n))
        if op == "write":
            _pour(conn, n, buf)
            _recv_exact(conn, 1)
        else:
            _drain(conn, n, buf)
    except BaseException as exc:  # handed to the caller
        errors.append(exc)


def _trial(conns: list[socket.socket], shares: list[int], op: str) -> float:
    errors: list[BaseException] = []
    start = threading.Barrier(len(conns) + 1)
    threads = [threading.Thread(target=_one_stream, args=(c, n, op, start, errors))
               for c, n in zip(conns, shares, strict=True)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds


def run_client(host: str, port: int, streams: int) -> None:
    """Open ``streams`` connections, then answer each stdin line ``{"op", "bytes"}`` with
    ``{"seconds"}`` of one trial over them, until stdin closes.  The connections live as long as
    the client, as an engine's do, so no trial pays for a handshake or a fresh RTO estimate."""
    conns = [socket.create_connection((host, port), timeout=600) for _ in range(streams)]
    print(json.dumps({"connected": streams}), flush=True)
    try:
        for line in sys.stdin:
            ask = json.loads(line)
            total = int(ask["bytes"])
            shares = [total // streams + (1 if i < total % streams else 0) for i in range(streams)]
            print(json.dumps({"seconds": _trial(conns, shares, ask["op"])}), flush=True)
    finally:
        for c in conns:
            c.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flagcx_mc.tools.bench.plain_streams")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=0)
    c = sub.add_parser("client")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--streams", type=int, default=4)
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        serve(args.host, args.port)
    else:
        run_client(args.host, args.port, args.streams)
    return 0


if __name__ == "__main__":
    sys.exit(main())


class PlainStreams:
    """The limit over a link: a server in the target's namespace and a client in the initiator's,
    both for a whole bench run; ``measure`` asks the client for one trial."""

    def __init__(self, target_prefix: list[str], initiator_prefix: list[str], target_addr: str,
                 streams: int = 4) -> None:
        self._server = subprocess.Popen(
            target_prefix + [sys.executable, "-m", __name__, "serve", "--host", target_addr],
            stdout=subprocess.PIPE, text=True)
        self._client: subprocess.Popen | None = None
        try:
            port = int(self._first_line(self._server, "port"))
            self._client = subprocess.Popen(
                initiator_prefix + [sys.executable, "-m", __name__, "client", "--host", target_addr, "--port",
                                    str(port), "--streams", str(streams)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self._first_line(self._client, "connected")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _first_line(proc: subprocess.Popen, key: str) -> float:
        line = proc.stdout.readline() if proc.stdout else ""
        try:
            return float(json.loads(line)[key])
        except (ValueError, KeyError, TypeError):
            raise RuntimeError(f"plain streams: expected {key!r} from a side of the limit, got {line!r}") from None

    def measure(self, op: str, total: int) -> float:
        """GB/s of one trial moving ``total`` bytes in the direction of ``op``."""
        if self._client is None or self._client.stdin is None:
            raise RuntimeError("plain streams: the client is gone")
        self._client.stdin.write(json.dumps({"op": op, "bytes": total}) + "\n")
        self._client.stdin.flush()
        seconds = self._first_line(self._client, "seconds")
        return total / seconds / 1e9 if seconds > 0 else 0.0

    def close(self) -> None:
        for proc in (self._client, self._server):
            if proc is None:
                continue
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe:
                    pipe.close()
