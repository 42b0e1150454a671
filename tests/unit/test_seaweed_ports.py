"""Each local S3 server gets inner ports of its own (infra/seaweed.py `inner_ports`): weed puts
a unix socket per port at a fixed path in /tmp that every network namespace shares, so two
servers on the same ports (two stacks, a test beside `rollart up`) took each other's sockets
over and answered S3 InternalError."""

from __future__ import annotations

import random

import infra.seaweed as seaweed


def test_inner_ports_skip_ports_whose_socket_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(seaweed, "SOCKET_DIR", tmp_path)
    first = seaweed.inner_ports(random.Random(7))
    assert list(first) == list(seaweed.COMPONENTS)
    assert sorted(first.values()) == list(range(first["master"], first["master"] + 5))
    assert max(first.values()) + seaweed.GRPC_OFFSET < 65536
    # Another server's gRPC socket for one of those ports: the same draw moves elsewhere.
    taken = first["filer"] + seaweed.GRPC_OFFSET
    (tmp_path / f"seaweedfs-filer-grpc-{taken}.sock").touch()
    second = seaweed.inner_ports(random.Random(7))
    assert second != first
    assert taken not in {p for port in second.values() for p in (port, port + seaweed.GRPC_OFFSET)}
