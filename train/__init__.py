"""Eyrie stage: train."""
