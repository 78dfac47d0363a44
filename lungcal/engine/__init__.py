"""The old name of :mod:`lungcal.ctapp` (the CT application), kept so that old import paths still work.

The package was renamed ``lungcal.ctapp`` (issue 44 item 4: ``engine`` read as MONAI's/ignite's engines).
Stored runs name its classes by their old paths: a checkpoint's or ``config/resolved.json``'s ``_target_``
(``lungcal.engine.model.steps.MILTrainStep``), an MLflow parameter, a ``$import lungcal.engine.train.stage1``
of a bundle. Importing this module therefore

* installs :class:`_Alias` at the head of ``sys.meta_path``, so that ``import lungcal.engine.X.Y`` (any
  dotted submodule) returns the very module object ``lungcal.ctapp.X.Y`` (one module, not a second copy:
  its classes are the same classes, ``isinstance`` holds across both names);
* makes ``lungcal.engine`` itself the module ``lungcal.ctapp`` (``sys.modules``), so its attributes are
  ctapp's.

MONAI's ``ConfigParser``/``locate`` (``pydoc.locate``) and ``importlib.import_module`` resolve old
``_target_`` paths through it. ``lungcal.ctapp`` is imported lazily (``importlib``, no ``import``
statement), so the layer contracts of ``pyproject.toml`` see no import from here. New code imports
``lungcal.ctapp``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

OLD = __name__  # "lungcal.engine"
NEW = OLD.rpartition(".")[0] + ".ctapp"  # "lungcal.ctapp"


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finder and loader of ``lungcal.engine.<rest>``: the module is ``lungcal.ctapp.<rest>`` itself."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(OLD + "."):
            return None
        real = importlib.util.find_spec(NEW + fullname[len(OLD):])
        if real is None:  # no such module: the import system raises ModuleNotFoundError naming ``fullname``
            return None
        return importlib.machinery.ModuleSpec(fullname, self, loader_state=real.name,
                                              is_package=real.submodule_search_locations is not None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(spec.loader_state)
        # the import system sets ``__spec__`` of the module it gets to the alias spec: keep the real one
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        alias = module.__spec__
        if alias is not None and isinstance(alias.loader, _Alias):
            module.__spec__ = alias.loader_state  # the module's own spec (``lungcal.ctapp.<rest>``)


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
sys.modules[OLD] = importlib.import_module(NEW)
