"""Run-time pieces shared by the CT application (``lungcal.ctapp``) and ``cifar_baselines`` (a leaf: it imports
no lungcal package).

- ``device.py``: one meaning of ``device: auto`` and of ``seed`` (:func:`resolve_device`, :func:`seed_everything`);
- ``resume.py``: crash-safe runs: run identity, ignite checkpoints with every RNG state, resume;
- ``bundle_config.py``: the MONAI bundle config a run records (params, resolved sections);
- ``exit_hook.py``: a ``LungcalError`` under ``python -m monai.bundle run`` ends in one line, exit code 2.
- ``bundle_checks.py``: a recipe run without its base, or an override of a key no file defines, stops in one
  line before any work starts.
- ``parallel.py``: one CT's CPU numerics in slabs on torch's thread count, bit for bit the one-thread values.
"""
from lungcal.runtime.device import resolve_device, seed_everything

__all__ = ["resolve_device", "seed_everything"]
