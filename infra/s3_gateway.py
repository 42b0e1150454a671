"""The one way into the local S3 server: a TCP forwarder into `weed mini`'s private network.

`weed mini` serves S3 (which checks signatures) but also its master, volume and filer on
HTTP and gRPC ports that answer anyone who reaches them: read, overwrite and delete any object,
or run `weed shell`. So `infra/seaweed.py` starts it in a network namespace of its own, where
only its own loopback exists, and this process forwards one port: the host's S3 endpoint to the
S3 gateway inside. Nothing else of the server is reachable from the host's network. Entering
that namespace needs CAP_SYS_ADMIN over it: root, or (when the server was started by an
unprivileged user in a user namespace of its own) that user.

    python -m infra.s3_gateway --listen 127.0.0.1:PORT --pid WEED_PID --port INNER_PORT

The listening socket is made in the caller's namespace first, then this process joins the
server's namespace (single-threaded, as setns on a user namespace requires), so every
connection it opens to the gateway is made inside. It exits when the server's process is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import socket
import sys
import threading
import time

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
BUF = 1 << 18  # per direction of a connection; checkpoint uploads are large sequential streams


def ns_inode(pid: int | str, kind: str) -> int:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


def join_namespaces(pid: int) -> None:
    """Join `pid`'s network namespace (and first its user namespace, when it has its own).
    Refuses a target that shares ours: forwarding into our own network would expose nothing
    new but would mean the server is not isolated."""
    if ns_inode(pid, "net") == ns_inode("self", "net"):
        raise RuntimeError(f"pid {pid} shares this network namespace: the S3 server's side "
                           "ports would be reachable; refusing to forward")
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, flag in (("user", CLONE_NEWUSER), ("net", CLONE_NEWNET)):
        if kind == "user" and ns_inode(pid, "user") == ns_inode("self", "user"):
            continue
        fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, flag) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({kind}) into pid {pid}: {os.strerror(err)}")
        finally:
            os.close(fd)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy src -> dst until EOF, then half-close dst (HTTP keeps the other way open)."""
    buf = bytearray(BUF)
    view = memoryview(buf)
    try:
        while True:
            n = src.recv_into(buf)
            if n == 0:
                break
            dst.sendall(view[:n])
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _serve_one(client: socket.socket, port: int) -> None:
    try:
        upstream = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _watch(pid: int) -> None:
    """Exit with the server: a forwarder to nothing must not hold the endpoint's port."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:
            pass
        time.sleep(0.5)


def serve(listen_host: str, listen_port: int, pid: int, port: int) -> None:
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((listen_host, listen_port))
    lsock.listen(128)
    join_namespaces(pid)  # from here on, new sockets live in the server's network
    threading.Thread(target=_watch, args=(pid,), daemon=True).start()
    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=_serve_one, args=(conn, port), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True, help="HOST:PORT in this network namespace")
    ap.add_argument("--pid", type=int, required=True, help="the weed process")
    ap.add_argument("--port", type=int, required=True, help="its S3 port, inside")
    args = ap.parse_args(argv)
    host, _, lport = args.listen.rpartition(":")
    try:
        serve(host, int(lport), args.pid, args.port)
    except (OSError, RuntimeError) as err:
        print(f"s3 gateway: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
