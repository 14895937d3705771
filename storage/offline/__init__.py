"""resilient.storage.offline: the offline tools (convert, diff, verify, reshard, prune) behind
``resilient-ckpt``. They import the runtime (``resilient.storage``); the runtime never imports them."""
