"""Packages whose ``__init__`` runs later: the CLI reads the config dataclasses without torch.

``streamnmt.data`` and ``streamnmt.engine`` re-export their modules from ``__init__``, which imports
torch and numpy (most of a second or more); their config modules (``data/config.py``,
``engine/config.py``) import neither. :func:`defer` puts such a package into ``sys.modules`` as
the very module object its import makes, with its ``__init__`` not yet run, so that
``import streamnmt.data.config`` loads that one module alone: ``streamnmt train --help`` and a bad
flag answer before torch is imported. :func:`finish` runs the deferred ``__init__`` in that same
object (so every name, and every class identity, is the one a plain import gives), before the
command runs. A name asked of a deferred package before then runs its ``__init__`` first.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

_DEFERRED: dict[str, ModuleSpec] = {}


def defer(*packages: str) -> None:
    """Hold back the ``__init__`` of each of ``packages`` not imported yet (its parent is imported)."""
    for name in packages:
        if name in sys.modules:
            continue
        parent, _, child = name.rpartition(".")
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            raise ImportError(f"{name} is not a package that can be deferred")
        module = importlib.util.module_from_spec(spec)

        def __getattr__(attr: str, _name: str = name) -> object:  # PEP 562: a name its __init__ defines
            _run(_name)
            return getattr(sys.modules[_name], attr)

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        sys.modules[name] = module
        if parent:
            setattr(sys.modules[parent], child, module)
        _DEFERRED[name] = spec


def deferred() -> list[str]:
    """The packages whose ``__init__`` has not run yet."""
    return list(_DEFERRED)


def finish() -> None:
    """Run every deferred ``__init__`` (in the order deferred)."""
    for name in list(_DEFERRED):
        _run(name)


def _run(name: str) -> None:
    spec = _DEFERRED.pop(name, None)
    if spec is None:
        return
    module: ModuleType = sys.modules[name]
    del module.__getattr__
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        # as a failed import: the package is gone from sys.modules, and the next import says why again
        sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        if parent and getattr(sys.modules.get(parent), child, None) is module:
            delattr(sys.modules[parent], child)
        raise
