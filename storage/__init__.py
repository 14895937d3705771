"""resilient.storage"""
