"""The CT stages that the bundles of ``bundles/`` wire together (see docs/architecture.md).

- ``cohort`` / ``bagset``: datalist -> cached bags per split; the bag dataset and its augmentation;
- ``steps`` / ``schedule`` / ``handlers`` / ``predict``: MONAI engine pieces (MIL batches, mixup, LR, MLflow);
- ``stage1`` / ``posthoc`` / ``las`` / ``inference`` / ``recalibrate``: one run step per workflow (+ ``summary``);
- ``checkpoint`` / ``bundle_config``: one stage-1 loader (run id or file), the bundle config a run records;
- ``exit_hook``: a ``LungcalError`` under ``python -m monai.bundle run`` ends in one line, exit code 2.
"""
