"""A stranger on the loopback: a plain torchft Manager that registers with the job's lighthouse as
replica group 1, without the job secret, and tries to join the cross-group all-reduce. Run as
``python -m tests.recovery.quorum_stranger LIGHTHOUSE ROUNDS``; prints one JSON line per
round."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
from torch.distributed import TCPStore
from torchft.manager import Manager, WorldSizeMode
from torchft.process_group import ProcessGroupGloo, ReduceOp

from resilient.recovery.quorum import _QuorumClient


def main() -> None:
    lighthouse, rounds = sys.argv[1], int(sys.argv[2])
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        min_replica_size=1,
        use_async_quorum=False,
        replica_id="group00001",
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        world_size_mode=WorldSizeMode.DYNAMIC,
        init_sync=False,
    )
    # It derives quorum ids as the job's groups do (public information), so that it can build the
    # cross-group process group with them.
    manager._client = _QuorumClient(manager._client)
    for _ in range(rounds):
        manager.start_quorum()
        grad = torch.full((4,), 1000.0)  # what it would add to every real group's gradients
        manager.allreduce(grad, reduce_op=ReduceOp.SUM).wait()
        print(json.dumps({"participants": manager.num_participants(), "commit": manager.should_commit()}), flush=True)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
