"""``depthscope data``: the bundled probing samples (UD English EWT and GUM excerpts) by name, so a
shell command can use them: ``depthscope probe --train $(depthscope data ewt_train) ...``; the work
is :mod:`depthscope.analyses.jobs.data`."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from depthscope.analyses.commands.options import SHARED, Opt, command, opt, options
from depthscope.analyses.jobs import data as jobs
from depthscope.analyses.jobs.data import LICENCES, TREEBANKS, copy_samples, resolve, samples, samples_table

DATA = options(
    "name model copy force",
    extra=(
        Opt(
            "name",
            str | None,
            None,
            help="A sample (ewt_train, ewt_test, gum_train, gum_test) or generated set (agreement, ioi): its path.",
            argument=True,
            metavar="NAME",
        ),
        opt(
            "--copy",
            None,
            "Copy the samples (only NAME, when given) and their README (attribution, licences) into "
            "this folder and print the copies' paths.",
            Path | None,
        ),
        SHARED["force"].but(help="With --copy: overwrite files of the same name."),
    ),
)


@command("data", DATA)
def data(o) -> None:
    """The bundled probing samples: excerpts of the Universal Dependencies v2.16 English EWT
    and GUM treebanks that ship with depthscope.

    Without NAME: a table of the samples (sentences, words, path, licence). With NAME: the
    absolute path of that sample alone (agreement, ioi: counterfactual examples for the tokenizer
    of --model, written into --copy or the cache), for the shell:

      depthscope probe --train $(depthscope data ewt_train) --test $(depthscope data ewt_test)

    EWT is CC BY-SA 4.0; GUM is CC BY-NC-SA 4.0 (non-commercial use only). Cite the
    treebanks when publishing results (probes/data/README.md).
    """
    if o.name in jobs.GENERATED or o.model:  # counterfactual examples for --model's tokenizer (docs/localize.md)
        return typer.echo(str(jobs.generate(o.name, o.model, o.copy, force=o.force)))
    key, path = resolve(o.name) if o.name is not None else (None, None)
    if o.copy is not None:
        for p in copy_samples([key] if key else list(samples()), o.copy, force=o.force):
            typer.echo(str(p))
    elif path is not None:
        typer.echo(str(path))
    else:
        found = samples()
        console = Console(width=None if sys.stdout.isatty() else 200)  # logs and pipes: paths unbroken
        console.print(samples_table(found))
        readme = next(iter(found.values())).parent / "README.md"
        console.print(
            f"{TREEBANKS['ewt']}: {LICENCES['ewt']}; {TREEBANKS['gum']}: {LICENCES['gum']} (non-commercial use "
            f"only). Attribution: {readme}",
            soft_wrap=True,
        )
