"""resilient.storage.offline: the offline tools (convert, diff, verify, reshard, prune) behind
``resilient-ckpt``. They import the runtime (``resilient.storage``); the runtime never imports them."""

FORMATS = ("resilient", "safetensors", "torch", "dcp")
"""What ``resilient-ckpt convert`` reads and writes. Here, not in ``convert``: the command line's
parser names them without importing torch (``resilient-ckpt --help`` answers at once)."""
