"""Module names resolved late.

- :func:`lazy_attributes`: names a package loads on first use (PEP 562): its ``__getattr__`` and
  ``__dir__`` from a map of name -> the module that defines it. ``sgl_tts`` and ``sgl_tts.backends``
  use it so that importing a light module under them (the plugin, the wire protocol, the CPU engine's
  child process) does not load SGLang's frontend or the client's backends.
- :func:`moved_module`: an old module name kept as a deprecated alias of the module it moved to."""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any, Callable, Mapping


def lazy_attributes(package: str, names: Mapping[str, str], namespace: dict[str, Any]
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: a name in ``names`` is imported from its module on
    first use and kept in ``namespace`` (the package's globals), so later lookups skip the hook."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__


def moved_module(old: str, new: str) -> None:
    """Called by the module ``old`` (a name kept after its code moved to ``new``): warn that the name
    is deprecated and make ``old`` *be* ``new`` (``sys.modules``), so an old import, a private name
    or a monkeypatch reaches the code that runs."""
    module = importlib.import_module(new)
    # stacklevel 3: the importing code's frame, past this helper and the alias module
    warnings.warn(f"{old} is deprecated; import {new}", DeprecationWarning, stacklevel=3)
    sys.modules[old] = module
