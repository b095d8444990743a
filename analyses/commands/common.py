"""What every command does around its job: set threads, build its configuration and claim the output
folder (:func:`begin`), claim the store, load the model (:func:`loader`, :func:`load_model`), show the
summary (:func:`show`); the options are declared in :mod:`depthscope.analyses.commands.options`."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import typer
from rich.console import Console

from depthscope.analyses.jobs import base
from depthscope.analyses.jobs.base import prepare_store  # noqa: F401  (the commands' store check)
from depthscope.common.settings import build

_CLAIMS: list = []


def prepare_out(out: Path, command: str, identity: dict | None = None, force: bool = False) -> None:
    """Check and claim ``out`` before any compute (:func:`~depthscope.analyses.jobs.base.prepare_output`);
    the claim is released when the command ends (:func:`release_outputs`, called by the CLI)."""
    _CLAIMS.append(base.prepare_output(out, command, identity, force=force))


def release_outputs() -> None:
    """Release the output folders this command claimed (the CLI calls it when a command ends)."""
    while _CLAIMS:
        _CLAIMS.pop().release()


def begin(o, config: type, command: str, identity: dict | None = None, **fields):
    """A command's head, before any model loads, in this order: torch's threads, ``config`` built from the
    options ``o`` and ``fields``, ``o.out`` claimed for ``command`` (:func:`prepare_out`; ``identity``: what
    besides ``--model`` names the run, None: any run of ``command``). Returns the configuration."""
    set_threads(o.threads)
    cfg = build(config, o, **fields)
    who = None if identity is None else {"model": o.model or "default", **identity}
    prepare_out(o.out, command, who, getattr(o, "force", False))
    return cfg


def load(model: str | None, device: str = "cpu", dtype: str = "float32", stream: bool | None = None, why=None):
    """:func:`~depthscope.analyses.jobs.base.load_for_command` (``why``: why this command cannot stream)."""
    return base.load_for_command(model, device, dtype, stream, why)


def loader(o):
    """``load()`` of the options' model, once a job's data are checked; without ``--stream``: never streamed."""
    why = None if hasattr(o, "stream") else "it computes gradients, and a backward needs every block held"
    return functools.partial(load, o.model, o.device, o.dtype, getattr(o, "stream", None), why)


def load_model(o, show: bool = False):
    """The model the options ``o`` name (:func:`loader`), loaded now; ``show``: its description on stderr."""
    m = loader(o)()
    if show:
        Console(stderr=True).print(repr(m))
    return m


def show(table, files=()) -> None:
    """Print ``table`` (unless None) on stdout, 160 columns wide when stdout is no terminal (logs get no
    80-column squeeze), then ``wrote PATH`` for each of ``files``."""
    if table is not None:
        Console(width=None if sys.stdout.isatty() else 160).print(table)
    for p in files:
        typer.echo(f"wrote {p}")


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads: ``threads`` when given, checked first; else the free cores
    (:func:`depthscope.common.threads.auto_threads`)."""
    from depthscope.common import threads as torch_threads  # lazy: it imports torch, --help must not

    torch_threads.set_threads(torch_threads.auto_threads() if threads is None else threads, "--threads")
