"""resilient: checkpoint-first, fault-tolerant training runtime."""
