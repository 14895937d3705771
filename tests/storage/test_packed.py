"""Format version 3: a step is a few pack objects per rank whatever its tensor count; every array
opens with TensorStore alone (the spec in the manifest), local and on S3, bf16 included; a lost or
cut pack is an IntegrityError naming the step and the tensors it held."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from resilient import Checkpointer, IntegrityError
from resilient.errors import ConfigError
from resilient.storage import pack as pack_module
from resilient.storage.config import CheckpointerConfig
from resilient.storage.offline.convert import StreamConfig
from resilient.storage.pack import PACK_MAX_ENTRIES, PackBuilder, pack_name

pytestmark = pytest.mark.timeout(120)


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(96, 40, generator=g),
        "emb": torch.randn(33, 8, generator=g).to(torch.bfloat16),
        "ids": torch.arange(10, dtype=torch.int64),
        "scale": torch.tensor(2.5),
        "norms": {f"n{i}": torch.randn(5, generator=g) for i in range(12)},
        "step": 7,
    }


def _tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out |= _tensors(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_tensorstore_alone_opens_every_array_of_a_local_step(tmp_path):
    import tensorstore as ts

    state = _state()
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state).wait()
    manifest = json.loads((tmp_path / "step-000000001" / "manifest.json").read_text())
    assert manifest["format_version"] == 3
    for fqn, tensor in _tensors(state).items():
        # the documented line: ts.open(<manifest>["tensorstore"][fqn]) -- nothing of ours
        got = ts.open(manifest["tensorstore"][fqn]).result().read().result()
        assert got.dtype == _as_numpy(tensor).dtype, fqn
        assert np.array_equal(got, _as_numpy(tensor)), fqn
    (pack,) = (tmp_path / "step-000000001").glob("attempt-*/pack-*.zip")
    with zipfile.ZipFile(pack) as z:  # a valid ZIP: CRC-32 of every entry checks
        assert z.testzip() is None
        assert "w/0.0" in z.namelist() and "emb/zarr.json" in z.namelist()


def test_tensorstore_alone_opens_every_array_on_s3(s3_bucket, s3_endpoint):
    import boto3
    import tensorstore as ts

    state = _state()
    with Checkpointer(f"s3://{s3_bucket}/run") as ckpt:
        ckpt.save(1, state).wait()
        back = {**_state(), "step": 0}
        for t in _tensors(back).values():
            t.zero_()
        assert ckpt.load(back) == 1  # our own reader, through the packs
    assert all(torch.equal(a, b) for a, b in zip(_tensors(back).values(), _tensors(state).values(), strict=True))
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="run/")["Contents"]]
    assert len(keys) == 3, keys  # pack, manifest, latest (the coordinator keeps its own receipt in memory)
    manifest = json.loads(client.get_object(Bucket=s3_bucket, Key="run/step-000000001/manifest.json")["Body"].read())
    for fqn, tensor in _tensors(state).items():
        got = ts.open(manifest["tensorstore"][fqn]).result().read().result()
        assert np.array_equal(got, _as_numpy(tensor)), fqn


@pytest.mark.parametrize("count", [200, 2000])
def test_the_object_count_of_a_step_does_not_grow_with_its_tensors(tmp_path, count):
    state = {f"layers.{i}.norm": torch.full((4,), float(i)) for i in range(count)}
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state).wait()
        back = {k: torch.zeros(4) for k in state}
        ckpt.load(back)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    names = [p.name for p in _files(tmp_path)]
    assert sorted(names) == ["latest", "manifest.json", "pack-r00000-0.zip"]


def _damaged_steps(tmp_path: Path) -> tuple[Checkpointer, dict, Path]:
    ckpt = Checkpointer(str(tmp_path))
    s1 = {"w": torch.ones(64, 64), "b": torch.ones(3)}
    ckpt.save(1, s1).wait()
    ckpt.save(2, {"w": torch.full((64, 64), 2.0), "b": torch.full((3,), 2.0)}).wait()
    (pack,) = (tmp_path / "step-000000002").glob("attempt-*/pack-*.zip")
    return ckpt, s1, pack


def test_a_cut_pack_is_an_integrity_error_naming_the_step_and_its_tensors(tmp_path):
    ckpt, s1, pack = _damaged_steps(tmp_path)
    data = pack.read_bytes()
    pack.write_bytes(data[: len(data) // 3])
    target = {"w": torch.zeros(64, 64), "b": torch.zeros(3)}
    with pytest.raises(IntegrityError, match=r"at step 2 is damaged.*cut short.*its pack holds tensors 'b', 'w'"):
        ckpt.load(target)
    assert ckpt.load(target, step=1) == 1 and torch.equal(target["w"], s1["w"])


def test_a_missing_pack_is_an_integrity_error_naming_the_step_and_its_tensors(tmp_path):
    ckpt, _, pack = _damaged_steps(tmp_path)
    os.remove(pack)
    target = {"w": torch.zeros(64, 64), "b": torch.zeros(3)}
    with pytest.raises(IntegrityError, match=r"at step 2 is missing data.*pack that does not exist.*'b', 'w'"):
        ckpt.load(target)


def test_a_flipped_byte_in_a_pack_names_the_tensor_and_chunk(tmp_path):
    ckpt, _, pack = _damaged_steps(tmp_path)
    manifest = json.loads((tmp_path / "step-000000002" / "manifest.json").read_text())
    name, offset, _ = manifest["arrays"]["w"]["shards"]["0.0"]
    assert name == pack.name
    data = bytearray(pack.read_bytes())
    data[offset + 100] ^= 0xFF
    pack.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"checksum mismatch in tensor 'w' at step 2, inner chunk \{0, 0\}"):
        ckpt.load({"w": torch.zeros(64, 64), "b": torch.zeros(3)})


def test_a_pack_ends_before_zip_needs_zip64():
    builder = PackBuilder(lambda i: pack_name(3, i))
    refs = [builder.add(f"a/{i}", [b"x"]) for i in range(PACK_MAX_ENTRIES + 1)]
    assert [p.key for p in builder.packs] == ["pack-r00003-0.zip", "pack-r00003-1.zip"]
    assert refs[-1].pack == "pack-r00003-1.zip" and refs[-1].offset == 30 + len(f"a/{PACK_MAX_ENTRIES}")


def test_an_entry_too_big_for_a_pack_alone_is_refused_first_or_later(monkeypatch):
    # ZIP sizes are 32-bit (no ZIP64): an entry that does not fit an empty pack is refused, whether
    # it would open the first pack or a later one (it used to be laid out regardless).
    monkeypatch.setattr(pack_module, "PACK_MAX_BYTES", 1000)
    with pytest.raises(ValueError, match=r"entry 'a/0' of 1000 bytes does not fit a pack \(1000 bytes\)"):
        PackBuilder(lambda i: pack_name(0, i)).add("a/0", [bytes(1000)])
    builder = PackBuilder(lambda i: pack_name(0, i))
    assert builder.add("a/0", [bytes(900)]).offset == 33
    with pytest.raises(ValueError, match="entry 'a/1' of 2000 bytes does not fit a pack"):
        builder.add("a/1", [bytes(2000)])
    assert [len(p.entries) for p in builder.packs] == [1]


def test_shard_sizes_stay_within_what_a_pack_holds():
    with pytest.raises(
        ConfigError, match=r"max_shard_bytes=4294967296 is out of range: allowed \[1048576, 2147483648\]"
    ):
        CheckpointerConfig(max_shard_bytes=4 << 30)
    assert CheckpointerConfig(max_shard_bytes=2 << 30).max_shard_bytes == 2 << 30
    assert StreamConfig(max_memory=64 << 30).shard_bytes == 2 << 30  # convert: max_memory / 16 would be 4 GiB
    assert StreamConfig(max_memory=1 << 30).shard_bytes == 64 << 20


def test_a_full_local_load_fetches_each_shard_once_and_says_so(tmp_path):
    state = {"w": torch.randn(256, 64), "b": torch.randn(64), "step": 1}
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state).wait()
        ckpt.load({"w": torch.zeros(256, 64), "b": torch.zeros(64), "step": 0})
        stats = ckpt.restore_stats[-1]
    manifest = json.loads((tmp_path / "step-000000001" / "manifest.json").read_text())
    refs = sorted((ref[1], ref[2]) for a in manifest["arrays"].values() for ref in a["shards"].values())
    assert stats.bytes_read == (256 * 64 + 64) * 4
    # Both small shards in one read (packread): every chunk, its crc and its index once, and the
    # ZIP local header between the two shards, read along.
    (first, _), (last, last_nbytes) = refs
    header = 30 + len("w/0.0")
    assert refs[0][0] + refs[0][1] + header == last
    assert stats.bytes_fetched == last + last_nbytes - first


def _save_sharded(rank: int, world: int, url: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _sharded_reference()
    state = {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "emb": distribute_tensor(full["emb"], mesh, [Shard(1)]),  # uneven: 5 columns over 2 ranks
        "big": distribute_tensor(full["big"], mesh, [Replicate()]),  # replicas share its write
    }
    with Checkpointer(url) as ckpt:
        ckpt.save(2, state).wait()
    dist.barrier()
    return rank


def _sharded_reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "w": torch.randn(8, 6, generator=g),
        "emb": torch.randn(4, 5, generator=g).to(torch.bfloat16),
        "big": torch.randn(4096, 1024, generator=g),  # 16 MiB replicated: split between the replicas
    }


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_tensorstore_alone_opens_arrays_whose_shards_lie_in_several_ranks_packs(tmp_path):
    import tensorstore as ts

    from tests.dist import run_world

    run_world(_save_sharded, 2, str(tmp_path))
    manifest = json.loads((tmp_path / "step-000000002" / "manifest.json").read_text())
    packs = {ref[0] for a in manifest["arrays"].values() for ref in a["shards"].values()}
    assert packs == {"pack-r00000-0.zip", "pack-r00001-0.zip"}
    for fqn, tensor in _sharded_reference().items():
        assert len({ref[0] for ref in manifest["arrays"][fqn]["shards"].values()}) == 2, fqn  # both ranks wrote
        got = ts.open(manifest["tensorstore"][fqn]).result().read().result()
        assert np.array_equal(got, _as_numpy(tensor)), fqn
    files = [p.name for p in _files(tmp_path)]
    assert sorted(files) == sorted(
        ["latest", "manifest.json", "pack-r00000-0.zip", "pack-r00001-0.zip", "rank-00001.json"]
    )


def test_object_storage_loads_read_only_the_chunks_a_box_needs(tmp_path):
    from resilient.layout import Box
    from resilient.manifest import Manifest
    from resilient.storage.arrays import make_context
    from resilient.storage.config import CheckpointerConfig
    from resilient.storage.rangeread import WHOLE_SHARD_BYTES, read_ranged
    from resilient.storage.reader import ReadTarget
    from resilient.storage.url import parse_url

    url = "memory://packed-ranges/run"
    state = {"w": torch.randn(2048, 1024), "b": torch.randn(7)}  # w: 8 MiB, one shard of 64 KiB chunks
    with Checkpointer(url, config=CheckpointerConfig(inner_chunk_bytes=64 << 10)) as ckpt:
        ckpt.save(1, state).wait()
        manifest = Manifest.loads(ckpt.store.read("step-000000001/manifest.json"), where="test")
        location = parse_url(url)
        assert manifest.arrays["w"].shards["0.0"][2] > WHOLE_SHARD_BYTES  # the index-then-chunks path
        box = Box((100, 0), (600, 1024))
        dest = torch.zeros(600, 1024)
        small = torch.zeros(3)
        targets = [
            ReadTarget(manifest.arrays["w"], box, dest),
            ReadTarget(manifest.arrays["b"], Box((2,), (3,)), small),
        ]
        attempt = f"step-000000001/{manifest.attempt}"
        got = read_ranged(location, attempt, targets, make_context(location), step=1, budget_bytes=1 << 20)
    assert torch.equal(dest, state["w"][100:700]) and torch.equal(small, state["b"][2:5])
    assert got.needed == (600 * 1024 + 3) * 4
    assert got.needed < got.fetched < 1.1 * got.needed  # rows 96..704 in chunks of 16, the index, b's shard


def test_a_cut_pack_on_s3_is_an_integrity_error_and_the_older_step_loads(s3_bucket, s3_endpoint):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    with Checkpointer(f"s3://{s3_bucket}/run") as ckpt:
        ckpt.save(1, {"w": torch.ones(64, 64), "b": torch.ones(3)}).wait()
        ckpt.save(2, {"w": torch.full((64, 64), 2.0), "b": torch.full((3,), 2.0)}).wait()
        manifest = json.loads(
            client.get_object(Bucket=s3_bucket, Key="run/step-000000002/manifest.json")["Body"].read()
        )
        key = f"run/step-000000002/{manifest['attempt']}/pack-r00000-0.zip"
        data = client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        client.put_object(Bucket=s3_bucket, Key=key, Body=data[: len(data) // 3])
        target = {"w": torch.zeros(64, 64), "b": torch.zeros(3)}
        with pytest.raises(IntegrityError, match=r"step 2 is damaged: pack 'pack-r00000-0.zip' .*cut short.*'b', 'w'"):
            ckpt.load(target)
        client.delete_object(Bucket=s3_bucket, Key=key)
        with pytest.raises(IntegrityError, match=r"step 2 is missing data: pack .* does not exist.*'b', 'w'"):
            ckpt.load(target)
        assert ckpt.load(target, step=1) == 1 and torch.equal(target["w"], torch.ones(64, 64))
