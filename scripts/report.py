#!/usr/bin/env python
"""Build the study's comparison report from MLflow (same as ``lungcal report``).

Example::

    python scripts/report.py --experiment nlst --out runs/reports/nlst
"""
import sys

from lungcal.cli import main

if __name__ == "__main__":
    sys.exit(main(["report", *sys.argv[1:]]))
