#!/usr/bin/env python
"""Run the calibration study grid through the bundles (same as ``lungcal study``).

Example::

    python scripts/run_study.py --datasets nlst --preset reduced --dry-run
    python scripts/run_study.py --datasets cifar10 cifar10lt --preset full
"""
import sys

from lungcal.cli import main

if __name__ == "__main__":
    sys.exit(main(["study", *sys.argv[1:]]))
