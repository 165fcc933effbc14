"""Eyrie stage: extract."""
