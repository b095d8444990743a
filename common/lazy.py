"""Lazy exports for a package (PEP 562): a name is imported from its module on first use, so
importing the package costs nothing (no torch, pandas or matplotlib) until a name is used. The
command line's ``--help`` and the torch-free config modules inside each room depend on it.

``__getattr__, __dir__ = lazy_exports(__name__, {"name": "module", ...})`` in a package's
``__init__``; the module is relative to the package (``"logit"``) or absolute
(``"depthscope.common.digest"``). A name that is not exported resolves to a submodule of the
package when one has that name (``depthscope.analyses.lens.logit.plots``), else AttributeError. An
exported name never names a submodule of its package (``tests/test_api_names.py`` checks every
``__all__``), so ``from package import name`` gives the same object whether or not the submodule
was imported before.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys


def lazy_exports(package: str, exports: dict[str, str]) -> tuple:
    """``(__getattr__, __dir__)`` for ``package`` exporting ``exports`` (name -> module)."""

    def __getattr__(name: str):
        mod = exports.get(name)
        if mod is not None:
            target = mod if mod.startswith("depthscope.") else f"{package}.{mod}"
            value = getattr(importlib.import_module(target), name)
            setattr(sys.modules[package], name, value)  # the next lookup is a plain attribute
            return value
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
