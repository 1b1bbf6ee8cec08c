"""Run a callback once a module has been imported (now, if it already is).

Capture waits for ``torch``; the source patcher waits for each patch's target module. The finder
wraps the real loader, so the module executes as usual and the callback sees it complete.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections import defaultdict
from collections.abc import Callable

_callbacks: dict[str, list[Callable]] = defaultdict(list)


def when_imported(name: str, callback: Callable) -> None:
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _callbacks[name].append(callback)
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _NotifyingLoader(spec.loader, fullname)
        return spec


class _NotifyingLoader(importlib.abc.Loader):
    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for callback in _callbacks.pop(self._name, []):
            callback(module)

    def __getattr__(self, name):  # get_source, is_package, ... as the real loader has them
        return getattr(self._loader, name)
