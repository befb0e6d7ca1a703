"""Names a package loads on first use (PEP 562).

:func:`lazy_attributes` gives a package's ``__getattr__`` and ``__dir__`` from a map of name -> the
module that defines it. ``sgl_tts`` and ``sgl_tts.backends`` use it so that importing a light module
under them (the plugin, the wire protocol, the CPU engine's child process) does not load SGLang's
frontend or the client's backends."""

from __future__ import annotations

import importlib
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
