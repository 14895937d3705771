"""resilient.recovery"""
