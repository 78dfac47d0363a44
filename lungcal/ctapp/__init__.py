"""The CT stages that the bundles of ``bundles/`` wire together, in rooms (see docs/architecture.md).

Each room imports only the rooms below it (an import-linter contract in ``pyproject.toml``)::

    site                      a hospital's own data: ``lungcal site-check``, ``recalibrate``, ``adapt-curve``
    train      infer          stage 1, post-hoc, ensemble, LAS  |  scoring new CTs (``lungcal predict``)
    evaluate                  reports, summaries, calibrators a run stores, case records, pictures
    model      data           engine steps, handlers, checkpoints, predict  |  cohort, series checks, bags

``commands.py`` registers the CT application's sub-commands with the CLI (lazily).
"""
