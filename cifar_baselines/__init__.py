"""CIFAR-10 / CIFAR-10-LT baselines of the calibration study, as MONAI bundles on the lungcal toolkit.

- ``data.py``: CIFAR-10 files, long-tailed subset, splits; ``batches.py``: CPU-seeded batch sampling, augmentation.
- ``resnet.py``: ResNet-32; ``schedule.py``: warm-up + step learning rate; ``steps.py``: train / eval iterations.
- ``handlers.py``: MLflow epoch metrics and the checkpoint; ``stages.py``: the tracked stage-1 (+ TS) and LAS runs.
- ``bundle.py`` / ``__main__.py``: ``python -m cifar_baselines bundles/<base>.json [bundles/<recipe>.json] --k v``.

Bundles: ``bundles/cifar10lt_ce.json`` (stage 1) and ``bundles/cifar10lt_las.json`` (LAS) are complete; every other
``bundles/cifar10{,lt}_*.json`` holds only what differs and is merged over its base; see docs/cifar.md.
"""
