"""Package discovery for the design card's layout: the top-level folders common/, hooks/, probes/ and
analyses/ install as depthscope.common, depthscope.hooks, depthscope.probes and depthscope.analyses, with every
sub-package found here (a folder with an ``__init__.py``), so a new sub-package can never be
left out of the wheel. Everything else (metadata, dependencies, package data) is in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = ("common", "hooks", "probes", "analyses")

packages = []
for root in ROOTS:
    packages += [f"depthscope.{root}"] + [f"depthscope.{root}.{sub}" for sub in find_packages(root)]

setup(packages=packages, package_dir={f"depthscope.{root}": root for root in ROOTS})
