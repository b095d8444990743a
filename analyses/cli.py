"""The ``depthscope`` command line (typer). Each sub-command lives in ``analyses/commands/``
and registers itself through a ``register(app)`` function; this file only assembles them."""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil

import typer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(
    name="depthscope",
    help="Which depth of a transformer encodes which property, and how the residual stream gets there.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _load_commands() -> None:
    from . import commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        if hasattr(mod, "register"):
            mod.register(app)


_load_commands()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from depthscope.hooks.errors import DepthscopeError
    from depthscope.hooks.runtime import tune_allocator

    tune_allocator()  # this process is ours: keep large blocks in the heap (see hooks/runtime.py)
    try:
        app()
    except DepthscopeError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
