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


class CommitError(ResilientError):
    """A save attempt could not be committed; the previous committed step is untouched."""


class IntegrityError(ResilientError):
    """Stored bytes do not match their checksum (names the step, tensor FQN and chunk)."""


class RestoreError(ResilientError):
    """A checkpoint cannot be restored into the given state (lists every mismatch)."""


class QuorumTimeout(ResilientError, TimeoutError):
    """A quorum or collective decision did not complete within its timeout."""
