"""Scoring new CTs with a trained model: ``lungcal predict`` and ``bundles/inference.json``."""
