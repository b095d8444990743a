"""Exported names are the objects they name, never modules: every name in every package's
``__all__`` imports (``from package import name``) to a function, class or value, before and after
its submodules are imported, and no exported name is also the name of a submodule of that package
(Python would then bind the module over it once the submodule is imported, as
``from depthscope.analyses import path_patching`` once returned the module). Every public function
or class that the docs' API pages name is importable from its package root."""

from __future__ import annotations

import importlib
import pkgutil
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("depthscope.common", "depthscope.hooks", "depthscope.probes", "depthscope.analyses")


def packages() -> list[str]:
    """Every package (a folder with ``__init__.py``) under the four roots."""
    out = []
    for root in ROOTS:
        out.append(root)
        mod = importlib.import_module(root)
        out += [m.name for m in pkgutil.walk_packages(mod.__path__, root + ".") if m.ispkg]
    return sorted(set(out))


def submodules(package: str) -> set[str]:
    mod = importlib.import_module(package)
    return {m.name for m in pkgutil.iter_modules(mod.__path__)}


@pytest.mark.parametrize("package", packages())
def test_no_exported_name_is_a_module(package):
    mod = importlib.import_module(package)
    names = getattr(mod, "__all__", [])
    clash = sorted(set(names) & submodules(package))
    assert clash == [], f"{package} exports names that are also its submodules: {clash}"
    for name in names:
        value = getattr(mod, name)
        assert not isinstance(value, types.ModuleType), f"{package}.{name} is a module"
        # the same object through the import statement, and after every submodule was imported
        ns: dict = {}
        exec(f"from {package} import {name} as value", ns)
        assert ns["value"] is value or ns["value"] == value
    for sub in submodules(package):
        if sub.startswith("_"):
            continue
        try:
            importlib.import_module(f"{package}.{sub}")
        except ImportError as e:  # an optional dependency (Ray) may be missing: the name check still holds
            if "ray" not in str(e).lower():
                raise
    for name in names:
        assert not isinstance(getattr(mod, name), types.ModuleType), f"{package}.{name} became a module"


def test_path_patching_and_sweep_are_the_functions():
    from depthscope.analyses import path_patching, sweep
    from depthscope.analyses.circuits.patching import paths  # noqa: F401  (its module imported first: no shadowing)
    from depthscope.analyses.sweeps import series  # noqa: F401

    assert callable(path_patching) and path_patching.__name__ == "path_patching"
    assert callable(sweep) and sweep.__name__ == "sweep"


def _doc_api_names() -> set[tuple[str, str]]:
    """``(package root, name)`` of every ``::: depthscope.<root>....<Name>`` entry of docs/api/ whose
    last part is a public function or class (a lowercase or capitalised name)."""
    out = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        for line in page.read_text().splitlines():
            m = re.match(r":::\s+(depthscope\.(common|hooks|probes|analyses)(\.[\w.]+)?)\.(\w+)\s*$", line.strip())
            if m and not m.group(4).startswith("_"):
                out.add((f"depthscope.{m.group(2)}", m.group(4), m.group(1)))
    return out


@pytest.mark.parametrize("root, name, where", sorted(_doc_api_names()))
def test_every_name_the_api_pages_document_is_exported_from_its_package_root(root, name, where):
    obj = getattr(importlib.import_module(where), name)
    if isinstance(obj, types.ModuleType) or not (callable(obj) or isinstance(obj, type)):
        pytest.skip(f"{where}.{name} is a value, not a function or class")
    pkg = importlib.import_module(root)
    assert name in getattr(pkg, "__all__", []), f"{name} ({where}) is documented but not exported from {root}"
    assert getattr(pkg, name) is obj
