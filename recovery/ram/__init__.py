"""The RAM tier (tier 1): node-local snapshots copied to a buddy node, restored without storage."""
