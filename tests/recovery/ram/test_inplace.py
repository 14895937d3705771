"""A snapshot restored straight into the training tensors (``recovery/ram/inplace.py``), over a real
authenticated channel where the bytes travel."""

from __future__ import annotations

import secrets

import crc32c
import pytest
import torch

from resilient.recovery.channel import ReplicationClient, ReplicationServer, Scatter
from resilient.recovery.ram.inplace import TensorLanding, copy_verified, tensor_targets
from resilient.recovery.snapshot_format import CrcAsItLands, SnapshotIndex, checksum, layout_tensors, tensor_view

pytestmark = pytest.mark.timeout(60)


def _snapshot(tensors: dict[str, torch.Tensor]) -> tuple[SnapshotIndex, torch.Tensor]:
    """A snapshot of ``tensors`` as the tier lays one out (aligned offsets, gaps between tensors)."""
    entries, nbytes = layout_tensors(tensors)
    data = torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # gap bytes that must not land anywhere
    for entry in entries:
        tensor_view(data, entry).copy_(tensors[entry.fqn])
        entry.crc32c = checksum(data, entry)
    return SnapshotIndex(step=3, rank=0, topology={}, tensors=entries, values={}, nbytes=nbytes), data


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 70, generator=g),  # 84,000 bytes: several 1 MiB-or-less pieces, odd tail
        "b": torch.randn(7, generator=g).bfloat16(),  # 14 bytes: a 50-byte gap follows
        "empty": torch.empty(0),
        "step": torch.tensor(float(seed)),  # 0-d
    }


class _Holder:
    """A buddy that keeps one snapshot and serves it."""

    def __init__(self, index: SnapshotIndex, data: torch.Tensor) -> None:
        self.index, self.data = index, data

    def put(self, sender_rank: int, key: str, header: dict, payload: memoryview) -> None:
        raise AssertionError("not used")

    def get(self, requester_rank: int, key: str) -> tuple[dict, memoryview]:
        return {"index": self.index.to_json()}, memoryview(self.data.numpy())


def _fetch_into(index: SnapshotIndex, data: torch.Tensor, target: dict) -> tuple[TensorLanding, Scatter]:
    secret = secrets.token_bytes(32)
    targets = tensor_targets(index, target)
    assert targets is not None
    landing = TensorLanding(index, targets)
    with (
        ReplicationServer(secret, _Holder(index, data), host="127.0.0.1", timeout_s=10.0) as server,
        ReplicationClient(secret, server.address, rank=0, timeout_s=10.0) as client,
    ):
        reply = client.get("rank0/step-000000003", into=lambda header, nbytes: landing.scatter())
    assert reply is not None
    return landing, reply[1]


def test_a_buddys_copy_lands_in_the_tensors_gaps_aside_and_is_checksummed_as_it_lands():
    source = _state(1)
    index, data = _snapshot(source)
    target = _state(2)
    pointers = {fqn: t.data_ptr() for fqn, t in target.items()}
    landing, payload = _fetch_into(index, data, target)
    assert landing.corruption() is None
    for fqn, tensor in source.items():
        assert torch.equal(target[fqn], tensor), fqn
        assert target[fqn].data_ptr() == pointers[fqn]  # the same memory: nothing was reallocated
    # w, gap, b, gap, (empty: nothing), step, tail
    assert [view.nbytes for view in payload.views] == [84000, 32, 14, 50, 4, 60]


def test_a_copy_that_does_not_match_its_crc_is_named():
    source = _state(1)
    index, data = _snapshot(source)
    data[index.tensors[1].offset + 3] ^= 0x10  # a flipped bit in "b" on the buddy
    landing, _ = _fetch_into(index, data, _state(2))
    assert landing.corruption() == "crc32c mismatch in tensor 'b'"


def test_an_own_snapshot_is_copied_in_pieces_and_every_piece_is_checked(monkeypatch):
    monkeypatch.setattr("resilient.recovery.ram.inplace.COPY_PIECE_BYTES", 4096)  # w spans 21 pieces
    source = _state(1)
    index, data = _snapshot(source)
    target = _state(2)
    targets = tensor_targets(index, target)
    assert targets is not None
    assert copy_verified(index, data, targets) is None
    assert all(torch.equal(target[fqn], t) for fqn, t in source.items())
    data[index.tensors[0].offset + 80_000] ^= 1  # in w's last piece
    assert copy_verified(index, data, targets) == "crc32c mismatch in tensor 'w'"
    assert crc32c.crc32c(targets["w"]) != index.tensors[0].crc32c  # what landed is the damaged bytes


def test_tensors_that_cannot_take_the_bytes_in_place_send_the_restore_to_fresh_memory():
    index, _ = _snapshot(_state(1))
    strided = _state(2)
    strided["w"] = torch.randn(70, 300).t()  # same shape, not one dense block
    assert tensor_targets(index, strided) is None
    resized = _state(2)
    resized["w"] = torch.randn(300, 71)
    assert tensor_targets(index, resized) is None
    assert tensor_targets(index, {k: v for k, v in _state(2).items() if k != "b"}) is None
    meta = _state(2)
    meta["w"] = torch.empty(300, 70, device="meta")
    assert tensor_targets(index, meta) is None
    subclass = _state(2)
    subclass["w"] = torch.randn(300, 70).as_subclass(_Marked)  # no .numpy(): the old way, not an error
    assert tensor_targets(index, subclass) is None


class _Marked(torch.Tensor):
    pass


def test_crc_as_it_lands_matches_the_crc_of_the_bytes_for_any_cut_and_order():
    source = _state(3)
    index, data = _snapshot(source)
    index.tensors.reverse()  # an index lists its tensors in any order; the payload is by offset
    payload = memoryview(data.numpy())
    rng = torch.Generator().manual_seed(0)
    for _ in range(50):
        crc = CrcAsItLands(index)
        cuts = sorted(torch.randint(0, index.nbytes, (5,), generator=rng).tolist())
        for start, end in zip([0, *cuts], [*cuts, index.nbytes], strict=True):
            crc(payload[start:end])  # pieces of any size, empty ones included
        assert crc.corruption() is None
    partial = CrcAsItLands(index)
    partial(payload[:100])
    assert partial.corruption() == f"100 of the snapshot's {index.nbytes} bytes were checksummed"


def test_tensors_that_overlap_in_an_index_are_refused_before_anything_lands():
    index, _ = _snapshot(_state(1))
    index.tensors[1].offset = 100  # "b" now inside "w"
    with pytest.raises(ValueError, match="overlaps"):
        CrcAsItLands(index)
    with pytest.raises(ValueError, match="overlaps"):
        TensorLanding(index, tensor_targets(index, _state(2)) or {})
