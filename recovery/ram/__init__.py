"""The RAM tier (tier 1): node-local snapshots copied to a buddy node, restored without storage.

This face is what the rest of the code imports (held by ``tests/test_layering.py``): the tier, the
outcome of its restore, and where a run's node stores are (tools, chaos and the tests wipe them to
lose a node). Its modules import each other, never the face.
"""

from resilient.recovery.ram.restore import RamRestore
from resilient.recovery.ram.store import node_store_dir, run_dir_key, store_root
from resilient.recovery.ram.tier import RamTier

__all__ = ["RamRestore", "RamTier", "node_store_dir", "run_dir_key", "store_root"]
