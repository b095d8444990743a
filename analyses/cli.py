"""The ``depthscope`` command line (typer). Each sub-command lives in ``analyses/commands/``, its
body marked by ``@command(name, options)`` (or added by the module's ``register(app)``); this file
only assembles them."""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import os
import pkgutil
import typing
from importlib.metadata import PackageNotFoundError, version

import typer

from depthscope.analyses import commands
from depthscope.analyses.commands.common import release_outputs
from depthscope.analyses.commands.options import add
from depthscope.common.errors import DepthscopeError, OutputError
from depthscope.common.runtime import tune_allocator

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


def _version(value: bool):
    """``--version``: the installed distribution's version, then exit."""
    if value:
        try:
            typer.echo(f"depthscope {version('depthscope')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("depthscope (not installed)")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the installed version and exit."
    ),
) -> None:
    """Which depth of a transformer encodes which property, and how the residual stream gets there."""


def _finite(value):
    """Option callback: a float option is a finite number (``nan`` and ``inf`` parse as floats)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _numeric(hint) -> type | None:
    """``int`` or ``float`` for a (possibly optional) numeric annotation, else None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0] if len(args) == 1 and args[0] in (int, float) else None


def _guard(fn):
    """Every command: a float option must be finite (a callback added to each float option), a
    numeric option's type reads ``<int>``/``<float>`` before its range, and a
    :class:`DepthscopeError` is printed as ``error: ...`` without a traceback (exit 1 for an
    output place that cannot be written, 2 for bad input)."""
    hints = typing.get_type_hints(fn)
    for name, p in inspect.signature(fn).parameters.items():
        info = p.default
        kind = _numeric(hints.get(name))
        if kind is not None and isinstance(info, typer.models.ParameterInfo):
            if kind is float and info.callback is None:
                info.callback = _finite
            if info.metavar is None:  # "<int>", not "<int range>": the range follows it ("[x>=1]")
                info.metavar = f"<{kind.__name__}>"

    @functools.wraps(fn)
    def command(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DepthscopeError as e:
            typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1 if isinstance(e, OutputError) else 2) from None
        finally:
            release_outputs()  # the output folders' locks (and a failed run's empty folder)

    return command


def _load_commands() -> None:
    """Register every command module's commands (its functions marked by
    :func:`~depthscope.analyses.commands.options.command`, in the order they are defined, then those
    its ``register(app)`` adds), each wrapped by :func:`_guard`."""
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        for body in vars(mod).values():
            if inspect.isfunction(body) and body.__module__ == mod.__name__ and hasattr(body, "command"):
                add(app, *body.command, body)
        if hasattr(mod, "register"):
            mod.register(app)
    groups = [g.typer_instance for g in app.registered_groups]  # ``depthscope sae train``
    for cmd in [c for t in [app, *groups] for c in t.registered_commands]:
        cmd.callback = _guard(cmd.callback)


_load_commands()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    tune_allocator()  # this process is ours: keep large blocks in the heap (see common/runtime.py)
    try:
        app()
    except DepthscopeError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        typer.secho(
            "interrupted: files already written are whole, no partial file is left", fg=typer.colors.RED, err=True
        )
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
