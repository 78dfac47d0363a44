"""Tests of the one-off experiments in ``experiments/`` (loaded by path)."""
