"""Helpers of the RAM-tier tests: states, a one-snapshot writer, and rank functions (module level:
spawned processes import them)."""

from __future__ import annotations

import logging
import os

import torch

from resilient.recovery.config import RamTierConfig
from resilient.recovery.ram.store import RankStore, node_store_dir
from resilient.recovery.ram.tier import RamTier
from resilient.recovery.snapshot_format import SnapshotIndex, checksum, layout_tensors, local_tensors, tensor_view
from resilient.state import flatten_state


def write_snapshot(
    store: RankStore, step: int, value: float, *, publish: bool = True, tags: tuple[str, str] = ("", "")
) -> str:
    """Put a two-tensor snapshot of ``step`` (values ``value``, tagged ``(run_id, timeline)``) into
    ``store``; returns its slot."""
    tensors = {"a": torch.full((5, 3), value), "b": torch.full((4,), value).bfloat16()}
    entries, nbytes = layout_tensors(tensors)
    slot, data = store.reserve(nbytes)
    for entry in entries:
        tensor_view(data, entry).copy_(tensors[entry.fqn])
        entry.crc32c = checksum(data, entry)
    if publish:
        store.publish(
            SnapshotIndex(
                step=step,
                rank=0,
                topology={},
                tensors=entries,
                values={"v": value},
                slot=slot,
                nbytes=nbytes,
                run_id=tags[0],
                timeline=tags[1],
            )
        )
        store.release(slot)
    return slot


def state_of(rank: int, step: int) -> dict:
    """A small training-like state whose values name (rank, step)."""
    base = float(rank * 1000 + step)
    return {
        "model": {"w": torch.full((64, 32), base), "b": torch.full((7,), base).bfloat16()},
        "optim": {"step": torch.tensor(float(step))},
        "train": {"step": step, "rank": rank},
    }


def empty_state() -> dict:
    return {
        "model": {"w": torch.zeros(64, 32), "b": torch.zeros(7).bfloat16()},
        "optim": {"step": torch.tensor(0.0)},
        "train": {"step": -1, "rank": -1},
    }


def tier(rank: int, world: int, store_dir: str, *, per_node: int = 1, keep: int = 2) -> RamTier:
    config = RamTierConfig(store_dir=store_dir, ranks_per_node=per_node, replication_timeout_s=30.0)
    ram = RamTier(
        config,
        keep=keep,
        run_dir=os.path.join(store_dir, "run"),
        group=0,
        rank=rank,
        world_size=world,
        fingerprint={"dp_shard": world, "tp": 1},
    )
    ram.start()
    return ram


def take_snapshots(rank: int, world: int, store_dir: str, steps: list[int]) -> dict:
    """Snapshot each step, wait for publish + replication; report stats and the channel secret."""
    logging.basicConfig(level=logging.DEBUG)
    ram = tier(rank, world, store_dir)
    for step in steps:
        ram.snapshot(step, state_of(rank, step))
        ram.wait(30)
    # Every rank's copies have landed before any rank stops its server: a rank done first closed it
    # under its peer's last copy ("Broken pipe", the copy "failed"; seen twice in make test).
    torch.distributed.barrier()
    ram.close()
    return {"stats": ram.stats.records, "secret": ram._secret.hex()}


def count_snapshots_into_fresh_memory(state: dict) -> list[int]:
    """From now on in this process, each whole snapshot of ``state``'s layout that lands in fresh
    memory (the client's, wire, or the decision's own) is appended to the list returned; a copy
    fetched from a buddy lands in an anonymous mapping whatever its size (as 8 MiB and more do)."""
    from resilient.recovery.channel import wire
    from resilient.recovery.ram import restore as ram_restore

    wire.MAPPED_BUFFER_MIN_BYTES = 1
    fresh, snapshot_bytes, mapped = wire.fresh_buffer, layout_tensors(local_tensors(flatten_state(state)))[1], []

    def counting(nbytes: int) -> bytearray | memoryview:
        if nbytes == snapshot_bytes:  # a whole snapshot, not a reply header
            mapped.append(nbytes)
        return fresh(nbytes)

    wire.fresh_buffer = ram_restore.fresh_buffer = counting  # the name the decision imported too
    return mapped


def corrupt_kept_copies(store_dir: str, run_dir: str, rank: int, *, node: int) -> list[int]:
    """Flip a bit of the first tensor of every copy of ``rank``'s snapshots kept on ``node`` (one
    rank per node, group 0); the steps of those copies."""
    config = RamTierConfig(store_dir=store_dir, ranks_per_node=1)
    kept = RankStore(os.path.join(node_store_dir(config, run_dir, 0, node), "buddy", f"rank{rank}"), keep=2)
    for index in kept.indexes().values():
        kept.data(index)[index.tensors[0].offset] ^= 1
    return sorted(kept.indexes())


def restore(rank: int, world: int, store_dir: str, persistent_step: int | None) -> dict:
    """A restarted rank: restore into an empty state; report the outcome, the values, the whole
    snapshots that landed in fresh memory and the crc32c passes over a snapshot after it was all
    there (``first_corruption``; a buddy's copy is checksummed as it lands instead). A copy fetched
    from a buddy lands in an anonymous mapping whatever its size (as snapshots of 8 MiB and more
    do), so these small states test that path too."""
    from resilient.recovery.ram import restore as ram_restore

    check = ram_restore.first_corruption
    state = empty_state()
    snapshots_into_fresh_memory, crc_passes = count_snapshots_into_fresh_memory(state), []

    def checking(index: SnapshotIndex, data: torch.Tensor) -> str | None:
        crc_passes.append(index.step)
        return check(index, data)

    ram_restore.first_corruption = checking
    ram = tier(rank, world, store_dir)
    # In place with a persistent step behind the decision, as the policy passes it without a reinit.
    outcome = ram.restore(state, persistent_step, in_place=persistent_step is not None)
    ram.close()
    w = float(state["model"]["w"][0, 0])
    return {
        "fresh_memory": len(snapshots_into_fresh_memory),
        "crc_passes": len(crc_passes),
        "step": outcome.step,
        "source": outcome.source,
        "sources": outcome.sources,
        "bytes": outcome.bytes,
        "excluded": outcome.excluded,
        "w": w,
        "b_equal": bool(torch.equal(state["model"]["b"], torch.full((7,), w).bfloat16())),
        "optim_step": float(state["optim"]["step"]),
        "train": state["train"],
    }


def start_failing_on(rank: int, world: int, store_dir: str, bad_rank: int) -> dict:
    """Start a tier whose channel cannot listen on ``bad_rank`` (an address no interface has)."""
    bind_host = "203.0.113.1" if rank == bad_rank else ""  # TEST-NET-3: never a local address
    config = RamTierConfig(store_dir=store_dir, ranks_per_node=1, bind_host=bind_host)
    ram = RamTier(
        config, keep=1, run_dir=os.path.join(store_dir, "run"), group=0, rank=rank, world_size=world, fingerprint={}
    )
    try:
        ram.start()
    except Exception as e:
        server = ram._server
        return {
            "type": type(e).__name__,
            "message": str(e),
            "server_closed": server is None or server._closing.is_set(),
        }
    ram.close()
    return {"type": None}
