"""Eyrie stage: launch."""
