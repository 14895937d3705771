"""resilient.chaos"""
