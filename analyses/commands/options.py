"""Command-line options generated from configuration fields (:func:`depthscope.common.settings.setting`
declares each: default, flag, bounds, help), and the options that are no field (:data:`SHARED`).
:func:`options` lists a command's options in help order, :func:`command` marks a body receiving their
values (:func:`add` registers it), which builds its configuration with :func:`~depthscope.common.settings.build`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import typer

from depthscope.analyses.jobs.configs import ModelSpec
from depthscope.common.errors import InputError
from depthscope.common.settings import Limit, Opt, config_opts, opt


def checked(o: Opt) -> Callable:
    """Option callback: :meth:`Opt.check_value`; a failure is a usage error (exit 2) naming the flag."""

    def callback(value):
        try:
            return o.check_value(value)
        except InputError as e:  # click names the flag first: "... '--x': must be ..."
            raise typer.BadParameter(str(e).removeprefix(f"{o.flag} ")) from None

    return callback


def parameter(o: Opt) -> inspect.Parameter:
    """The typer parameter of ``o`` (a fresh ``typer.Option``/``typer.Argument`` each call); a
    numeric option is checked on parsing (:func:`checked`), before any model loads."""
    if o.argument:
        info = typer.Argument(o.default, metavar=o.metavar, help=o.help)
    else:
        top = None if isinstance(o.max, Limit) else o.max  # a machine's bound: read when checked
        call = checked(o) if o.kind is not None else None
        info = typer.Option(o.default, *o.flags, help=o.help, min=o.min, max=top, callback=call)
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Parameter(o.name, kind, default=info, annotation=o.annotation)


def options(names: str, *configs, extra=(), helps: dict | None = None, required: str = "") -> list[Opt]:
    """The options ``names`` (space-separated, in help order): each is an :class:`Opt` of
    ``extra``, a field of one of ``configs``, or one of :data:`SHARED`; ``helps`` rewords some
    for this command, ``required`` (space-separated) have no default here."""
    known = {**SHARED}
    for cls in configs:
        known.update(config_opts(cls))
    known.update({o.name: o for o in extra})
    for n, text in (helps or {}).items():
        known[n] = known[n].but(help=text)
    for n in required.split():
        known[n] = known[n].but(default=...)
    return [known[n] for n in names.split()]


def command(name: str, opts: list[Opt]) -> Callable:
    """Mark the decorated ``body(o)`` as command ``name`` with the options ``opts``: the CLI registers
    each marked function of a command module, in the order they are defined (:func:`add`)."""

    def mark(body: Callable) -> Callable:
        body.command = (name, opts)
        return body

    return mark


def add(app: typer.Typer, name: str, opts: list[Opt], body: Callable) -> None:
    """Register ``body(o)`` as command ``name`` of ``app`` with the options ``opts``; ``o`` is a
    namespace of the parsed values by option name. The body's docstring is the command's help."""

    def callback(**values):
        return body(SimpleNamespace(**values))

    callback.__signature__ = inspect.Signature([parameter(o) for o in opts])
    callback.__annotations__ = {o.name: o.annotation for o in opts}
    callback.__doc__, callback.__name__ = body.__doc__, body.__name__
    app.command(name)(callback)


#: the options that are no analysis' setting, declared once: the model (:class:`ModelSpec`'s
#: fields), the output folder, the text
SHARED = {
    **config_opts(ModelSpec),
    **{
        o.name: o
        for o in (
            opt("--out -o", Path("depthscope-out"), "Output folder for tables and plots."),
            opt(
                "--text -t",
                ...,
                "Plain-text file (UTF-8): one document per non-blank line, or the whole file as one "
                "(--whole-file); a .conllu file gives its sentences (e.g. $(depthscope data ewt_test)).",
                Path,
            ),
            opt("--force", False, "Write into an output folder that holds another run."),
            opt("--whole-file", False, "Read the file as one document instead of one per line."),
            opt(
                "--per-line/--whole-file",
                True,
                "One document per non-blank line (default), or the whole file as one document.",
            ),
        )
    },
}
