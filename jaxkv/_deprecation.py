"""Deprecated aliases of names that left a package's public API (kept one release).

A package lists its old names as ``{old name: "private.module"}`` (or
``"private.module:attribute"`` where the object was renamed) and, where the replacement is not
the private name itself, what to use instead. `deprecated_getattr` builds the package's
module-level ``__getattr__``, which returns the object with a `DeprecationWarning` naming the
replacement. These names are in no ``__all__`` and not in the package namespace; docs/guide.md,
"Deprecated names", lists them.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["deprecated_getattr"]


def deprecated_getattr(
    package: str, modules: Mapping[str, str], uses: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """The ``__getattr__`` of `package` that serves its deprecated names with a warning.

    Args:
      package: the package's name, for the messages.
      modules: each deprecated name's module (``"module:attribute"`` for a renamed object).
      uses: what to use instead, by name (the message adds the private ``module.attribute``
        unless this is a public ``jaxkv.`` name).

    Example:
      >>> import warnings
      >>> getter = deprecated_getattr("pkg", {"old": "math:pi"}, {"old": "math.pi"})
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     value = getter("old")
      >>> round(value, 2), caught[0].category.__name__
      (3.14, 'DeprecationWarning')
      >>> str(caught[0].message).endswith("release: use math.pi (internal: math.pi)")
      True
    """
    uses = dict(uses or {})

    def __getattr__(name: str) -> Any:  # noqa: N807  (a module's __getattr__)
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = modules[name].partition(":")
        attribute = attribute or name
        private = f"{module}.{attribute}"
        if name not in uses:
            use = f"{private} (internal)"
        elif uses[name].startswith("jaxkv."):  # a public replacement
            use = uses[name]
        else:
            use = f"{uses[name]} (internal: {private})"
        warnings.warn(f"{package}.{name} is deprecated and will be removed in the next release: "
                      f"use {use}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), attribute)

    return __getattr__
