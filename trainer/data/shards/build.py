"""``resilient-data build``: SRC (a folder or a JSON-lines manifest) -> media shards (docs/shards.md).

Steps: discover samples; probe every media file and read every caption (a thread pool); train the
tokenizer on the kept samples' text; cut samples, sorted by key, into shards of about
``shard_size`` bytes; write each tar and its index; write tokenizer.json and skipped.jsonl; write
manifest.json last, so a DEST without one is an unfinished build. Nothing of the host (time, user,
thread scheduling) reaches the output: two builds of the same SRC are byte-identical.

An S3 DEST is staged in a local temp folder; each shard is uploaded (and its local copy deleted)
as soon as it is written, so local disk holds one shard at a time.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass, field

from resilient.errors import ConfigError, StorageError, disk_full
from resilient.storage.url import parse_url
from resilient.trainer.data.shards import format as fmt
from resilient.trainer.data.shards.discover import Skip, discover
from resilient.trainer.data.shards.probe_pool import ProbedSample, probe_all
from resilient.trainer.data.shards.text import (
    MAX_VOCAB_SIZE,
    MIN_VOCAB_SIZE,
    PAD,
    all_strings,
    text_bytes,
    token_counts,
    train_tokenizer,
)

logger = logging.getLogger(__name__)

TAR_BLOCK = 512
"""A tar header is one block; member data is padded to whole blocks."""
_END_OF_ARCHIVE = 2 * TAR_BLOCK
"""Two zero blocks close a tar (tarfile then pads to a 10 KiB record: shards may exceed the target by that)."""
_FIXED_MTIME = 0
"""Every member's mtime (with uid/gid 0 and empty owner names): builds do not depend on the host."""


@dataclass(kw_only=True, slots=True)
class BuildConfig:
    src: str
    """A folder (samples = files sharing a stem) or a JSON-lines manifest."""
    dest: str
    """A new or empty local folder, or s3://bucket/prefix with nothing under it."""
    shard_size: int = 256 << 20
    """Target tar size in bytes; a shard holds at least one sample, so one big sample may exceed it."""
    workers: int = 8
    """Threads probing media; [1, 256]."""
    vocab_size: int = 512
    """Most tokens of the byte-level BPE (incl. <pad>); [257, 2**20]."""
    progress: bool = False
    """Show tqdm bars on stderr."""
    max_duration_s: float = 600.0
    """Longer samples are skipped: a training window decodes from its whole member (one read of
    it per window), so an hour-long file would be read hundreds of times an epoch. Split it first."""

    def __post_init__(self) -> None:
        if not os.path.exists(self.src):
            raise ConfigError(f"SRC {self.src!r} does not exist; give a folder of media or a .jsonl manifest")
        if os.path.isdir(self.src) and not _has_files(self.src):
            raise ConfigError(f"SRC folder {self.src!r} is empty; put media files (and captions) in it")
        if os.path.isfile(self.src) and os.path.getsize(self.src) == 0:
            raise ConfigError(f"SRC manifest {self.src!r} is empty; give one JSON object per line (id, video, audio)")
        if not self.max_duration_s > 0:
            raise ConfigError(f"max_duration_s must be > 0 seconds, got {self.max_duration_s}")
        if self.shard_size < 1:
            raise ConfigError(f"shard_size must be >= 1 byte, got {self.shard_size} (e.g. 256MiB)")
        if not 1 <= self.workers <= 256:
            raise ConfigError(f"workers must be in [1, 256], got {self.workers}")
        if not MIN_VOCAB_SIZE <= self.vocab_size <= MAX_VOCAB_SIZE:
            raise ConfigError(
                f"vocab_size must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}] (256 byte symbols + {PAD}), "
                f"got {self.vocab_size}"
            )


@dataclass(slots=True)
class BuildSummary:
    dest: str
    samples: int
    audio_s: float
    video_s: float
    skipped: int
    shards: int
    bytes: int
    seconds: float
    fingerprint: str

    def line(self) -> str:
        return (
            f"{self.samples} samples, {self.audio_s / 3600:.3f} h audio, {self.video_s / 3600:.3f} h video, "
            f"{self.skipped} skipped, {self.shards} shards, {_human(self.bytes)} in {self.seconds:.1f} s -> {self.dest}"
        )


def _has_files(folder: str) -> bool:
    return any(not n.startswith(".") for _, _, names in os.walk(folder) for n in names)


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


# -- the build ----------------------------------------------------------------------------------


def build(config: BuildConfig) -> BuildSummary:
    started = time.monotonic()
    destination = _Destination(config.dest, config.src)
    try:
        candidates, skipped = discover(config.src)
        samples, probe_skips = probe_all(candidates, workers=config.workers, progress=config.progress)
        skipped += probe_skips
        too_long = [s for s in samples if s.duration_s > config.max_duration_s]
        samples = [s for s in samples if s.duration_s <= config.max_duration_s]
        skipped += [
            Skip(
                path=s.files[0][1],
                reason=f"{s.duration_s:.1f} s is longer than --max-duration {config.max_duration_s:g} s: "
                "split it into shorter files (every training window reads the whole file)",
            )
            for s in too_long
        ]
        for skip in skipped:
            logger.info("skipped %s: %s", skip.path, skip.reason, extra={"event": "skipped", **skip.to_json()})
        if not samples:
            first = f": {skipped[0].path}: {skipped[0].reason}" if skipped else ""
            raise ConfigError(f"SRC {config.src!r} has no usable sample ({len(skipped)} inputs skipped{first})")
        samples.sort(key=lambda s: s.key)
        tokenizer = train_tokenizer((t for s in samples for t in all_strings(s.text)), config.vocab_size)
        shards = _write_shards(destination, _cut(samples, config.shard_size), tokenizer, config.progress)
        gone = {skip.key for shard in shards for skip in shard.skipped}
        skipped += [skip.skip for shard in shards for skip in shard.skipped]
        samples = [s for s in samples if s.key not in gone]
        manifest = _finish(destination, shards, samples, skipped, tokenizer)
    finally:
        destination.cleanup()
    return BuildSummary(
        dest=config.dest,
        samples=manifest["samples"],
        audio_s=manifest["audio_s"],
        video_s=manifest["video_s"],
        skipped=manifest["skipped"],
        shards=len(manifest["shards"]),
        bytes=sum(s["bytes"] for s in manifest["shards"]),
        seconds=time.monotonic() - started,
        fingerprint=manifest["fingerprint"],
    )


def _member_bytes(size: int) -> int:
    """Header plus data padded to whole blocks: what a member adds to the tar."""
    return TAR_BLOCK + -(-size // TAR_BLOCK) * TAR_BLOCK


def _sample_bytes(sample: ProbedSample) -> int:
    return sum(_member_bytes(size) for _, _, size in sample.files) + _member_bytes(len(text_bytes(sample.text)))


def _cut(samples: list[ProbedSample], shard_size: int) -> list[list[ProbedSample]]:
    """Consecutive runs of samples, each run's members summing to at most shard_size (or one sample)."""
    shards: list[list[ProbedSample]] = []
    current, current_bytes = [], _END_OF_ARCHIVE
    for sample in samples:
        size = _sample_bytes(sample)
        if current and current_bytes + size > shard_size:
            shards.append(current)
            current, current_bytes = [], _END_OF_ARCHIVE
        current.append(sample)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


@dataclass(slots=True)
class _Dropped:
    """A sample left out while its shard was written (its file changed since it was probed)."""

    key: str
    skip: Skip


@dataclass(slots=True)
class _WrittenShard:
    tar: str
    index: str
    index_bytes: bytes
    samples: int
    bytes: int
    skipped: list[_Dropped] = field(default_factory=list)


def _write_shards(destination, shards, tokenizer, progress: bool) -> list[_WrittenShard]:
    from tqdm import tqdm

    total = sum(_sample_bytes(s) for shard in shards for s in shard)
    written = []
    with tqdm(total=total, desc="write", unit="B", unit_scale=True, disable=not progress) as bar:
        for number, shard in enumerate(shards):
            tar_name, index_name = fmt.shard_tar_name(number), fmt.shard_index_name(number)
            tar_path = destination.local(tar_name)
            entries, dropped = _write_tar(tar_path, shard, tokenizer, bar.update)
            index = {"tar": tar_name, "samples": entries}
            index_bytes = json.dumps(index, separators=(",", ":"), ensure_ascii=False).encode()
            _write_file(destination.local(index_name), index_bytes)
            tar_bytes = os.path.getsize(tar_path)
            destination.publish(tar_name)
            destination.publish(index_name)
            written.append(_WrittenShard(tar_name, index_name, index_bytes, len(entries), tar_bytes, dropped))
    return written


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # on disk before the manifest that names it


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, _FIXED_MTIME, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _add_member(tar: tarfile.TarFile, name: str, fileobj, size: int) -> list[int]:
    """Append one member; ``[offset of its data, size]``. The data offset is read back from where
    the archive ends after the member, so extra headers (PAX for a long or non-ASCII name) count."""
    tar.addfile(_tar_info(name, size), fileobj)
    return [tar.offset - _member_bytes(size) + TAR_BLOCK, size]


def _write_tar(path: str, samples: list[ProbedSample], tokenizer, advance) -> tuple[list[dict], list[_Dropped]]:
    """Write one shard's tar; its index entries, and the samples left out. Members of a sample are
    adjacent: media, then text. A sample whose file changed or went away since it was probed is
    left out (what it wrote of itself cut off again), named in skipped.jsonl: the build goes on."""
    entries, dropped = [], []
    with open(path, "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for sample in samples:
                start, count = tar.offset, len(tar.members)
                try:
                    members = _add_sample(tar, sample)
                except OSError as e:
                    f.seek(start)
                    f.truncate()
                    tar.offset = start
                    del tar.members[count:]
                    where = getattr(e, "filename", None) or sample.files[0][1]
                    dropped.append(_Dropped(sample.key, Skip(where, f"changed since it was probed: {e}")))
                    continue
                finally:
                    advance(_sample_bytes(sample))
                entries.append(_index_entry(sample, members, tokenizer))
        f.flush()
        os.fsync(f.fileno())
    return entries, dropped


def _add_sample(tar: tarfile.TarFile, sample: ProbedSample) -> dict:
    """One sample's members; OSError when a file no longer has the size it was probed with."""
    import io

    members = {}
    for ext, source, size in sample.files:
        with open(source, "rb") as media:
            now = os.fstat(media.fileno()).st_size
            if now != size:  # a grown file would be cut, a shrunk one end the tar mid-member
                changed = OSError(f"{size} bytes when probed, {now} now")
                changed.filename = source
                raise changed
            members[ext] = _add_member(tar, f"{sample.key}.{ext}", media, size)
    text = text_bytes(sample.text)
    members[fmt.TEXT_EXT] = _add_member(tar, f"{sample.key}.{fmt.TEXT_EXT}", io.BytesIO(text), len(text))
    return members


def _index_entry(sample: ProbedSample, members: dict, tokenizer) -> dict:
    return {
        "key": sample.key,
        "members": members,
        "video": sample.video_ext,
        "audio": sample.audio_ext,
        "duration_s": round(sample.duration_s, 6),
        "text": token_counts(tokenizer, sample.text),
    }


def _finish(destination, shards: list[_WrittenShard], samples, skipped: list[Skip], tokenizer) -> dict:
    """tokenizer.json and skipped.jsonl, then manifest.json: the build's commit point."""
    tokenizer_json = tokenizer.to_str().encode()
    _write_file(destination.local(fmt.TOKENIZER), tokenizer_json)
    destination.publish(fmt.TOKENIZER)
    lines = [json.dumps(s.to_json(), ensure_ascii=False) + "\n" for s in skipped]
    _write_file(destination.local(fmt.SKIPPED), "".join(lines).encode())
    destination.publish(fmt.SKIPPED)
    manifest = {
        "format": fmt.FORMAT,
        "version": fmt.VERSION,
        "fingerprint": fmt.fingerprint_of([s.index_bytes for s in shards], tokenizer_json),
        "tokenizer": {
            "file": fmt.TOKENIZER,
            "kind": "bpe",
            "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
            "pad_id": tokenizer.token_to_id(PAD),
        },
        "shards": [{"tar": s.tar, "index": s.index, "samples": s.samples, "bytes": s.bytes} for s in shards],
        "samples": len(samples),
        "audio_s": round(sum(s.audio_s for s in samples), 6),
        "video_s": round(sum(s.video_s for s in samples), 6),
        "skipped": len(skipped),
    }
    destination.commit_manifest(json.dumps(manifest, indent=1).encode() + b"\n")
    logger.info(
        "shard build committed: %d samples in %d shards",
        manifest["samples"],
        len(shards),
        extra={"event": "committed", "fingerprint": manifest["fingerprint"]},
    )
    return manifest


# -- where the files go --------------------------------------------------------------------------


@dataclass(slots=True)
class _Destination:
    """A local DEST is written in place (manifest by rename, last); an S3 DEST is staged in a temp
    folder and each file uploaded once complete (manifest last)."""

    dest: str
    src: str
    staging: str = ""
    _client: object = None
    _location: object = None
    _temp: bool = False
    _uploaded: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._location = parse_url(self.dest)
        if self._location.scheme == "s3":
            self._open_s3()
        elif self._location.scheme == "file":
            self._open_local()
        else:
            raise ConfigError(f"--out {self.dest!r}: give a local folder or s3://bucket/prefix")

    def _open_local(self) -> None:
        self.staging = "/" + self._location.prefix
        src = os.path.abspath(self.src)
        if os.path.commonpath([self.staging, src]) == src and os.path.isdir(src):
            raise ConfigError(f"--out {self.dest!r} lies inside SRC {self.src!r}; write the shards elsewhere")
        if os.path.isdir(self.staging) and os.listdir(self.staging):
            raise ConfigError(f"--out {self.dest!r} is not empty; give a new folder or delete this one")
        try:
            os.makedirs(self.staging, exist_ok=True)
        except OSError as e:  # a file in the path, no permission (a full disk is no setting to change)
            if disk_full(e):
                raise
            raise ConfigError(
                f"--out {self.dest!r} cannot be created ({e.strerror or e}); give a folder this user can write"
            ) from e

    def _open_s3(self) -> None:
        from resilient.storage.s3 import s3_client

        self._client = s3_client(self._location)
        prefix = self._location.join("") + "/" if self._location.prefix else ""
        try:
            listing = self._client.list_objects_v2(Bucket=self._location.bucket, Prefix=prefix, MaxKeys=1)
        except Exception as e:  # botocore ClientError / connection errors
            raise StorageError(f"listing {self.dest} failed: {e}; check the bucket, credentials and endpoint") from e
        if listing.get("KeyCount", 0):
            raise ConfigError(f"--out {self.dest!r} already holds objects; give a new prefix or delete them")
        self.staging, self._temp = tempfile.mkdtemp(prefix="resilient-data-"), True

    def local(self, name: str) -> str:
        return os.path.join(self.staging, name)

    def publish(self, name: str) -> None:
        """Upload a finished file to S3 and drop the staged copy (a no-op for a local DEST)."""
        if self._client is None:
            return
        key = self._location.join(name)
        try:
            self._client.upload_file(self.local(name), self._location.bucket, key)
        except Exception as e:  # boto3's S3UploadFailedError / ClientError / connection errors
            raise StorageError(f"uploading {name} to {self.dest} failed: {e}; check the bucket and credentials") from e
        os.remove(self.local(name))
        self._uploaded.append(name)

    def commit_manifest(self, data: bytes) -> None:
        if self._client is not None:
            _write_file(self.local(fmt.MANIFEST), data)
            self.publish(fmt.MANIFEST)
            return
        partial = self.local(fmt.MANIFEST + ".partial")
        _write_file(partial, data)
        os.replace(partial, self.local(fmt.MANIFEST))

    def cleanup(self) -> None:
        if self._temp:
            shutil.rmtree(self.staging, ignore_errors=True)
