"""The calibration study: the grid runner, the comparison report and the published numbers.

- ``runner.py``: plan and run dataset x stage-1 x stage-2 jobs through the bundles, resuming;
- ``report.py``: the study's tables (Markdown, CSV, HTML) from MLflow, beside the published numbers;
- ``published_results.csv``: the numbers the study reports;
- ``commands.py``: ``lungcal study`` and ``lungcal report``.
"""
