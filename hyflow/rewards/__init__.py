"""Scorers and reward managers."""
