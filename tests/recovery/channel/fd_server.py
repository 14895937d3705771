"""A replication server in a process with almost no file descriptors left (``RLIMIT_NOFILE``):
``python -m tests.recovery.channel.fd_server SECRET_HEX SPARE_FDS`` prints its port, serves ``key`` ->
b"value" until stdin closes."""

from __future__ import annotations

import os
import resource
import sys

from resilient.recovery.channel.server import ReplicationServer


class _One:
    def put(self, sender_rank: int, key: str, header: dict, payload: memoryview) -> None:
        raise RuntimeError("read only")

    def get(self, requester_rank: int, key: str) -> tuple[dict, bytes] | None:
        return ({}, b"value") if key == "key" else None


def main() -> None:
    secret, spare = bytes.fromhex(sys.argv[1]), int(sys.argv[2])
    server = ReplicationServer(secret, _One(), host="127.0.0.1", timeout_s=10.0)
    server.handshake_s = 1.0  # strangers are dropped quickly here
    server.start()
    in_use = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + spare, in_use + spare))
    print(server.address[1], flush=True)
    sys.stdin.read()
    server.close()


if __name__ == "__main__":
    main()
