"""What a build's SRC holds: a folder of files grouped by stem, or a JSON-lines manifest.

Nothing here opens media; it only decides which files make up which sample, and lists what it
cannot place (an unknown extension, a second video for one stem, a bad manifest line) as skipped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from resilient.errors import ConfigError
from resilient.trainer.data.shards.text import TextError, normalize

VIDEO_EXTS = ("mp4", "mkv", "webm")
AUDIO_EXTS = ("wav", "flac", "mp3", "m4a", "ogg")
TEXT_EXTS = ("json", "txt")
"""In order of preference: a ``.json`` caption (it may be timed) wins over a ``.txt`` one."""
_RESERVED_EXTS = frozenset(TEXT_EXTS)
"""Member extensions the build writes itself (the normalized text)."""


@dataclass(frozen=True, slots=True)
class Skip:
    """One line of skipped.jsonl."""

    path: str
    reason: str

    def to_json(self) -> dict:
        return {"path": self.path, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Candidate:
    """A sample before probing: its key and where its parts are."""

    key: str
    video_path: str | None = None
    audio_path: str | None = None
    text_path: str | None = None
    text: dict | None = None
    """Already-normalized text (from a manifest line); None means read ``text_path`` or no text."""
    origin: str = ""
    """What skipped.jsonl names when the whole sample is skipped."""


def sample_key(stem: str) -> str:
    """WebDataset splits member names at the first dot, and our keys are flat names; '#' names a
    window of a cut clip in ``samples.jsonl`` (``<key>#<window>``), so no key may hold one."""
    return stem.replace("/", "_").replace(".", "_").replace("#", "_")


def discover(src: str) -> tuple[list[Candidate], list[Skip]]:
    """The samples of SRC (a folder or a ``.jsonl`` manifest), and what could not be placed."""
    if os.path.isdir(src):
        candidates, skipped = _from_folder(src)
    else:
        candidates, skipped = _from_manifest(src)
    return _unique_keys(candidates, skipped)


def _unique_keys(candidates: list[Candidate], skipped: list[Skip]) -> tuple[list[Candidate], list[Skip]]:
    """``a.b`` and ``a_b`` both become key ``a_b``: keep the first (sorted by origin), skip the rest."""
    seen: dict[str, str] = {}
    kept = []
    for c in sorted(candidates, key=lambda c: c.origin):
        if c.key in seen:
            skipped.append(Skip(c.origin, f"key {c.key!r} is already used by {seen[c.key]}"))
        else:
            seen[c.key] = c.origin
            kept.append(c)
    return kept, skipped


# -- a folder -----------------------------------------------------------------------------------


def _files_by_stem(src: str, skipped: list[Skip]) -> dict[str, dict[str, str]]:
    """relative stem -> {ext: path}, walking SRC in sorted order (hidden files are ignored)."""
    groups: dict[str, dict[str, str]] = {}
    for folder, subfolders, names in os.walk(src):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        for name in sorted(n for n in names if not n.startswith(".")):
            path = os.path.join(folder, name)
            stem, dot, ext = os.path.relpath(path, src).replace(os.sep, "/").rpartition(".")
            ext = ext.lower()
            if not dot or not stem or ext not in (*VIDEO_EXTS, *AUDIO_EXTS, *TEXT_EXTS):
                skipped.append(Skip(path, "not a media or caption file (by its extension)"))
                continue
            groups.setdefault(stem, {})[ext] = path
    return groups


def _pick(files: dict[str, str], exts: tuple[str, ...], key: str, skipped: list[Skip]) -> str | None:
    present = [files[e] for e in exts if e in files]
    for extra in present[1:]:
        skipped.append(Skip(extra, f"sample {key!r} already has {os.path.basename(present[0])}"))
    return present[0] if present else None


def _from_folder(src: str) -> tuple[list[Candidate], list[Skip]]:
    skipped: list[Skip] = []
    candidates = []
    for stem, files in sorted(_files_by_stem(src, skipped).items()):
        key = sample_key(stem)
        video = _pick(files, VIDEO_EXTS, key, skipped)
        audio = _pick(files, AUDIO_EXTS, key, skipped)
        text = _pick(files, TEXT_EXTS, key, skipped)
        origin = video or audio or text or stem
        if video is None and audio is None:
            skipped.append(Skip(origin, "no media: a caption without a video or audio file of the same stem"))
            continue
        candidates.append(Candidate(key, video_path=video, audio_path=audio, text_path=text, origin=origin))
    return candidates, skipped


# -- a JSON-lines manifest ----------------------------------------------------------------------


def _from_manifest(src: str) -> tuple[list[Candidate], list[Skip]]:
    base = os.path.dirname(os.path.abspath(src))
    candidates, skipped = [], []
    try:
        with open(src, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"SRC {src!r} is neither a folder nor a JSON-lines manifest (not UTF-8 text); give the folder that holds it"
        ) from e
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{src}:{number}"
        try:
            candidates.append(_manifest_line(json.loads(line), base, where))
        except (ValueError, TextError) as e:  # json's JSONDecodeError is a ValueError
            skipped.append(Skip(where, str(e)))
        except RecursionError:  # a line nested deeper than the parser's stack
            skipped.append(Skip(where, "JSON nested too deeply to parse"))
    return candidates, skipped


def _manifest_line(row: object, base: str, where: str) -> Candidate:
    if not isinstance(row, dict):
        raise ValueError('expected a JSON object {"id", "video", "audio", "text", "segments"}')
    key = row.get("id")
    if not isinstance(key, str) or not key.strip():
        raise ValueError('"id" must be a non-empty string')
    video, audio = _media_path(row, "video", base), _media_path(row, "audio", base)
    if video is None and audio is None:
        raise ValueError('no media: give "video" and/or "audio" (paths relative to the manifest)')
    if video and audio and _ext(video) == _ext(audio):
        raise ValueError(f"video and audio are both .{_ext(video)}: a sample's members need distinct extensions")
    text_path, text = _manifest_text(row, base)
    return Candidate(
        sample_key(key.strip()), video_path=video, audio_path=audio, text_path=text_path, text=text, origin=where
    )


def _media_path(row: dict, field: str, base: str) -> str | None:
    value = row.get(field)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f'"{field}" must be a path string, got {type(value).__name__}')
    path = os.path.normpath(os.path.join(base, value))
    ext = _ext(path)
    if not ext or ext in _RESERVED_EXTS:
        raise ValueError(f'"{field}" {value!r} needs a media file extension (e.g. .mp4, .flac), not {ext!r}')
    return path


def _manifest_text(row: dict, base: str) -> tuple[str | None, dict | None]:
    """``text`` is the untimed text itself, or a caption file (``.txt``/``.json``, relative to the
    manifest) when it names one that exists; ``segments`` are timed segments given inline."""
    text, segments = row.get("text") or "", row.get("segments") or []
    if isinstance(text, str) and not segments and _ext(text) in TEXT_EXTS:
        path = os.path.normpath(os.path.join(base, text))
        if os.path.isfile(path):
            return path, None
    return None, normalize(text, segments)


def _ext(path: str) -> str:
    name = os.path.basename(path)
    return name.rpartition(".")[2].lower() if "." in name else ""
