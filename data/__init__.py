"""Eyrie stage: data."""
