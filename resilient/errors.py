"""One error hierarchy for everything a user can meet.

Every message says what went wrong, where (URL, tensor FQN, step, rank) and what to do about it.
Callers raise ``... from e`` so the underlying cause stays attached.
"""

from __future__ import annotations


class ResilientError(Exception):
    """Base class of every error raised by resilient."""


class ConfigError(ResilientError, ValueError):
    """A configuration value or argument is invalid (names the field and the allowed range)."""


class StateError(ResilientError, TypeError):
    """The state handed to save/load has a leaf or key resilient cannot store."""


class StorageError(ResilientError):
    """Storage is unreachable, missing, or refused an operation (names the URL)."""


class StagingTimeout(StorageError, TimeoutError):
    """No staging buffer came free in time: every one is held by a save still persisting."""


class CommitError(ResilientError):
    """A save attempt could not be committed; the previous committed step is untouched."""


class IntegrityError(ResilientError):
    """Stored bytes do not match their checksum (names the step, tensor FQN and chunk)."""


class RestoreError(ResilientError):
    """A checkpoint cannot be restored into the given state (lists every mismatch)."""


class QuorumTimeout(ResilientError, TimeoutError):
    """A quorum or collective decision did not complete within its timeout."""


class QuorumError(ResilientError):
    """A quorum was granted but this group cannot take part in it (its process group failed)."""


class RemoteError(ResilientError):
    """Stands as the ``__cause__`` of an error re-raised from another rank or process: its message
    is the remote traceback, so the place that failed is not lost in the hop."""


# --- classification -------------------------------------------------------------------------------

_DISK_FULL_ERRNOS = (28, 122)  # ENOSPC, EDQUOT (Linux)
_DISK_FULL_WORDS = ("No space left on device", "Disk quota exceeded")


def disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` (or an error it was raised from) is a full disk or an exhausted quota. Also
    after an error crossed ranks as a payload (``from_payload``): the errno is lost there, but its
    text ("[Errno 28] No space left on device") is kept in the message."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _DISK_FULL_ERRNOS:
            return True
        if any(word in str(err) for word in _DISK_FULL_WORDS):
            return True
        err = err.__cause__ or err.__context__
    return False


# --- errors across ranks and processes ------------------------------------------------------------
#
# An error crosses a process boundary as plain JSON (never a pickle: the receiving side must not
# execute anything a peer sent). It is rebuilt as the same class when that class is ours or one of
# a few builtins; anything else arrives as a ResilientError that names the original type.

_BUILTINS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    RuntimeError,
    OSError,
    TimeoutError,
    NotImplementedError,
)


def _class_name(cls: type) -> str:
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _error_classes() -> dict[str, type[BaseException]]:
    # Ours only (defined under resilient.*), by full name: a user's class of the same short name,
    # or one whose constructor takes other arguments, must not be rebuilt in its place.
    ours = [c for c in (ResilientError, *_subclasses(ResilientError)) if c.__module__.startswith("resilient.")]
    return {_class_name(c): c for c in (*_BUILTINS, *ours)}


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def to_payload(err: BaseException) -> dict[str, str]:
    """``{"type", "message", "traceback"}`` of ``err``: JSON-able, for another rank or process."""
    import traceback

    return {
        "type": _class_name(type(err)),
        "message": str(err) if not isinstance(err, KeyError) else str(err.args[0] if err.args else ""),
        "traceback": "".join(traceback.format_exception(err)),
    }


def from_payload(payload: dict[str, str], *, prefix: str = "") -> BaseException:
    """The error ``payload`` describes, ready to raise: the same class where known (else a
    ``ResilientError`` naming the type), ``prefix`` before its message, and a ``RemoteError``
    holding the remote traceback as its cause."""
    cls = _error_classes().get(payload.get("type", ""))
    message = payload.get("message", "")
    if cls is None:
        short = payload.get("type", "error").rpartition(".")[2]
        cls, message = ResilientError, f"{short}: {message}"
    err = cls(f"{prefix}{message}")
    err.__cause__ = RemoteError(f"remote traceback:\n{payload.get('traceback', '(none)')}")
    err.__suppress_context__ = True
    return err
