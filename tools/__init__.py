"""resilient.tools"""
