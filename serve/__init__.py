"""Eyrie stage: serve."""
