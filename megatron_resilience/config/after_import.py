"""Call a function once a module has been imported: now, if it is, else right after its import finishes.

Why: ``megatron_resilience.entry`` makes ``run.run`` check this package's tasks, and nemo_run may be imported
before or after it (``import nemo_run as run`` first, or ``from megatron_resilience.entry import pretrain``
first); importing nemo_run ourselves would cost a login node seconds whenever it is not used. Stdlib only.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable


def call_after_import(name: str, callback: Callable[[], None]) -> None:
    """``callback()`` now when ``name`` is imported, else once, right after ``import name`` finishes
    (:class:`_AfterImport`); a second registration of the same callback for a pending import is ignored."""
    if name in sys.modules:
        callback()
        return
    if not any(isinstance(f, _AfterImport) and (f.name, f.callback) == (name, callback) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport:
    """A ``sys.meta_path`` finder that calls ``callback()`` once, right after module ``name`` finished importing.

    It finds nothing itself: it asks the other finders for ``name``'s spec and wraps that spec's loader, whose
    ``exec_module`` runs the module, puts the real loader back (``__loader__``, ``__spec__.loader``), takes this
    finder off ``sys.meta_path`` and calls ``callback``. Any other name costs one string comparison. A failing
    callback is a warning, never a failed ``import nemo_run``."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenCall(spec.loader, self)
                return spec
        return None

    def fired(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            self.callback()
        except Exception as err:  # noqa: BLE001 - `import nemo_run` must still work
            warnings.warn(f"megatron_resilience: {self.callback.__qualname__} after importing {self.name} failed "
                          f"({type(err).__name__}: {err})", stacklevel=2)


class _ThenCall:
    """The module's own loader, then the finder's callback (every other attribute is the loader's)."""

    def __init__(self, loader: Any, hook: _AfterImport) -> None:
        self._loader, self._hook = loader, hook

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._hook.fired()
