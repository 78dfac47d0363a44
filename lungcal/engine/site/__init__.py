"""A hospital's own data: local recalibration of a shipped model (``lungcal recalibrate``)."""
