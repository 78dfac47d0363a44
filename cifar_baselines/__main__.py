"""``python -m cifar_baselines BUNDLE [--key value ...]`` (see :mod:`cifar_baselines.bundle`)."""
import sys

from cifar_baselines.bundle import main

sys.exit(main())
