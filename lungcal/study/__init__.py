"""The calibration study: the grid runner, the report and its sections, paired comparisons, the published numbers.

- ``runner.py``: plan and run dataset x stage-1 x stage-2 jobs through the bundles, resuming;
- ``report.py``: the study's tables (Markdown, CSV, HTML) from MLflow, beside the published numbers;
- ``sections.py``, ``classes.py``, ``posthoc.py``: the report's sections (``study``, ``classes``: accuracy
  per class and group; ``posthoc``: the post-hoc fixes of a CIFAR stage-1 run side by side);
- ``differences.py``: paired bootstrap differences (the study's claims; any two runs);
- ``uncertainty.py``: single model, MC dropout and deep ensemble, with and without TS, side by side;
- ``published_results.csv``: the numbers the study reports;
- ``commands.py``: ``lungcal study``, ``report``, ``compare`` and ``uncertainty``.
"""
