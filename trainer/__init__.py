"""resilient.trainer"""
