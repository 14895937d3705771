"""A rank SIGKILLed while it takes a batch from its loader worker (run as a script by
test_loader_killed_rank.py): it connects to the worker's fd-passing listener, then dies before
the handshake, as a rank does when its node is lost mid-step."""

from __future__ import annotations

import os
import signal
import socket
from multiprocessing import resource_sharer

from resilient.trainer.data.config import DataConfig
from resilient.trainer.data.loader import PrefetchLoader
from resilient.trainer.data.stream import RowKey, RowStream


def _die_mid_handoff(ident: tuple[str, int]) -> None:
    address, _ = ident
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(address)
    print("connected to the worker's fd listener", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    config = DataConfig(seed=7, num_samples=51, global_rows=4, packing_window=16, num_workers=1)
    stream = RowStream(config)
    loader = PrefetchLoader(stream, 0, 1)
    start = RowKey(0, 0)
    loader.batch_at(start)  # one batch the normal way: the worker is up and serving fds
    resource_sharer._ResourceSharer.get_connection = staticmethod(_die_mid_handoff)
    loader.batch_at(stream.advance(start, config.global_rows))


if __name__ == "__main__":
    main()
