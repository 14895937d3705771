"""The authenticated transport every tier uses: the RAM tier's buddy copies and the live heals.

Copies never travel over the training process group: a slow or dead peer must not stall a
collective, and nobody outside the job may plant or read a snapshot or a heal. Every peer and every
message is therefore authenticated with the job's secret (``secret``: one per job, never sent), and
anything that fails a check is dropped before a byte of it is stored.

The bytes on the wire (handshake, framing, encryption) are ``wire``'s; ``server`` and ``client`` are
the two ends that speak it; ``handler`` is what a server stores into and serves from. Ops: ``put``
-> ``ok`` | ``error``; ``get`` -> ``value`` (meta + payload) | ``missing`` | ``error``.

This face is what the rest of the code imports; the modules import each other, never the face.
"""

from resilient.recovery.channel.client import ReplicationClient
from resilient.recovery.channel.handler import ChannelHandler, DirectPutHandler, PutTarget
from resilient.recovery.channel.secret import SECRET_ENV, job_secret, secret_fingerprint, shared_secret
from resilient.recovery.channel.server import ReplicationServer, bind_host, lower_thread_priority
from resilient.recovery.channel.wire import ChannelError, Scatter, fresh_buffer

__all__ = [
    "SECRET_ENV",
    "ChannelError",
    "ChannelHandler",
    "DirectPutHandler",
    "PutTarget",
    "ReplicationClient",
    "ReplicationServer",
    "Scatter",
    "bind_host",
    "fresh_buffer",
    "job_secret",
    "lower_thread_priority",
    "secret_fingerprint",
    "shared_secret",
]
