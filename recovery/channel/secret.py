"""The secret every rank of one job shares: it keys the heal channel across groups, and each
group's RAM tier channel key is derived from it (``shared_secret``), so no key is ever
sent over a process group (plain TCP across nodes). It comes from what every rank shares:

1. ``$RESILIENT_JOB_SECRET`` (hex, at least 16 bytes) when set: multi-node jobs hand it out like
   any other secret (SLURM/Kubernetes secret store) to every node;
2. else ``<run.dir>/job.key``, created once (mode 0600, atomically: the first rank of any group
   wins the race) and read by every rank after. Run directories on a filesystem only this user
   may read keep it private; a key file another user owns or may read is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets

from resilient import dist as rdist
from resilient.errors import ConfigError
from resilient.recovery.channel.wire import check_secret
from resilient.runfiles import JOB_KEY_FILE

SECRET_ENV = "RESILIENT_JOB_SECRET"
# Domain separation: the heal channel is keyed with the job secret itself.
RAM_KEY_LABEL = b"resilient/ram/v1/group/"
_SECRET_BYTES = 32


def job_secret(run_dir: str) -> bytes:
    """The job's heal-channel key (see the module docstring for where it comes from)."""
    text = os.environ.get(SECRET_ENV, "").strip()
    if text:
        try:
            return check_secret(bytes.fromhex(text))
        except ValueError as e:
            raise ConfigError(
                f"${SECRET_ENV} must be at least 16 bytes as hex (e.g. `openssl rand -hex 32`): {e}"
            ) from e
    path = os.path.join(run_dir, JOB_KEY_FILE)
    if not os.path.exists(path):
        _create(path)
    return _read(path)


def _create(path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_hex(_SECRET_BYTES).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        # link() fails if the name exists: whoever links first wins, and readers see the name only
        # once it holds the whole key.
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)


def _read(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise ConfigError(f"cannot read the job key {path}: {e}; delete it to make a new one") from e
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise ConfigError(
                f"job key {path} must be owned by this user and readable by no one else (owner uid "
                f"{info.st_uid}, mode {oct(info.st_mode & 0o777)}): delete it, or set ${SECRET_ENV}"
            )
        text = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    try:
        return check_secret(bytes.fromhex(text))
    except ValueError as e:
        raise ConfigError(f"job key {path} is damaged ({e}); delete it to make a new one") from e


def shared_secret(run_dir: str, group: int) -> bytes:
    """The channel key of replica group ``group``, the same on every rank (collective: a check).

    Derived on every rank from the job secret (``job_secret``) and never sent: the
    group's process group runs over plain TCP across nodes, so a key sent on it could be read off
    the wire. Each group gets its own key, so a buddy copy cannot be replayed into another group.
    Every rank then shares a fingerprint of its key (HMAC of a fixed label: it reveals nothing of the
    key), so ranks whose job secret differs (a node that made its own job.key) fail here, together,
    with one line, rather than refusing each other's copies later.
    """
    keys: list[bytes] = []

    def derive() -> str:
        key = hmac.new(job_secret(run_dir), RAM_KEY_LABEL + str(group).encode(), hashlib.sha256).digest()
        keys.append(key)
        return hmac.new(key, b"fingerprint", hashlib.sha256).hexdigest()[:16]

    fingerprints = rdist.agree(derive, what="RAM tier channel key")
    if len(set(fingerprints)) > 1:
        ranks = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
        raise ConfigError(
            f"ranks {ranks} hold another job secret than rank 0 (run dir {run_dir}): give every "
            f"node the same ${SECRET_ENV}, or a run.dir on a filesystem every node shares"
        )
    return keys[0]


def secret_fingerprint(secret: bytes) -> str:
    """What may be shown of the job secret: an HMAC of a fixed label under it (it reveals nothing of
    the secret), equal for equal secrets: two groups compare theirs through the checkpoint root."""
    return hmac.new(secret, b"job secret fingerprint", hashlib.sha256).hexdigest()[:16]
