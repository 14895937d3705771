"""Real media in WebDataset shards: the build (``resilient-data build``) and the reader the trainer
uses (``ShardSet``). The format is docs/shards.md; ``format.py`` is its one reader.

    format.py      ShardSet, SampleEntry: manifest, indexes, one range read per member
    discover.py    SRC (folder or JSON-lines manifest) -> candidate samples
    probe.py       probe(path) -> MediaInfo: decodes a little of every stream
    probe_pool.py  probes every candidate in a thread pool
    text.py        normalized captions, the byte-level BPE, token counts
    build.py       the build: cut, write tars + indexes, tokenizer, skipped.jsonl, manifest last
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from resilient.lazy import lazy_exports

if TYPE_CHECKING:
    from resilient.trainer.data.shards.build import BuildConfig, BuildSummary
    from resilient.trainer.data.shards.format import SampleEntry, ShardSet
    from resilient.trainer.data.shards.probe import MediaInfo, ProbeError

__all__ = ["BuildConfig", "BuildSummary", "MediaInfo", "ProbeError", "SampleEntry", "ShardSet"]

# The functions build() and probe() share their modules' names, so they are not re-exported here
# (``shards.build`` must stay the module): import them from their modules.
# Imported on first use: opening a ShardSet should not import av, and probing should not import boto3.
__getattr__ = lazy_exports(
    __name__,
    {
        "BuildConfig": "resilient.trainer.data.shards.build",
        "BuildSummary": "resilient.trainer.data.shards.build",
        "SampleEntry": "resilient.trainer.data.shards.format",
        "ShardSet": "resilient.trainer.data.shards.format",
        "MediaInfo": "resilient.trainer.data.shards.probe",
        "ProbeError": "resilient.trainer.data.shards.probe",
    },
)
