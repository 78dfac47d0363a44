"""The old name of :mod:`cifar_baselines.stages`, kept so that old import paths still work.

Stored CIFAR runs name their run steps by the old module path (a ``_target_`` such as
``cifar_baselines.workflow.Stage1Run`` in ``config/resolved.json``, ``$import cifar_baselines.workflow``);
the module was renamed ``stages`` (issue 44 item 4; the bundle id ``workflow`` stays). Importing this
module gives the module :mod:`cifar_baselines.stages` itself (``sys.modules``), so every name resolves to
the same object. New code imports ``cifar_baselines.stages``.
"""
import importlib
import sys

sys.modules[__name__] = importlib.import_module(__name__.rpartition(".")[0] + ".stages")
