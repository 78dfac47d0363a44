"""The CT stages that the bundles of ``bundles/`` wire together (see docs/architecture.md).

- ``cohort`` / ``series_qc`` / ``bagset``: datalist -> series checks -> cached bags per split; the bag dataset;
- ``steps`` / ``schedule`` / ``handlers`` / ``predict``: MONAI engine pieces (MIL batches, mixup, AMP, LR, MLflow);
- ``stage1`` / ``posthoc`` / ``las`` / ``inference``: one run step per bundle workflow (+ ``summary``);
- ``recalibrate`` / ``recalibrate_summary`` / ``unlabelled`` / ``site_calibrator``: a site's own calibration;
- ``checkpoint`` / ``evaluate`` / ``stage2``: one stage-1 loader; test reports; a retrained head on features.
"""
