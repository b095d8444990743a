"""The localize job: which depth carries a variable the model computes with, written once.

=================================  ===========================================================
``LocalizeConfig``                 (in :mod:`depthscope.analyses.causal.variables.config`)
                                   the examples, the split, the method, sites, positions and
                                   DAS settings
``localize_job(model, config,      interchange or DAS on the examples; writes ``localize``
out, progress=)``                  (Parquet + CSV), ``localize_summary.json``, the figure
                                   ``localize_iia``, DAS's ``subspaces.safetensors`` and, with
                                   ``probe_task``, ``localize_probes`` and the figure
                                   ``localize_three_curves``; a :class:`JobResult`
``best_sites(table)``              per position, the site of the highest IIA (chosen on the
                                   test examples) and that IIA
``summary_table(table,             the console table: per position, the site of the highest
summary)``                         IIA and the first site where IIA reaches half of it; with
                                   ``only_solved``, a caption of the examples dropped
=================================  ===========================================================

Both methods are measured on the same held-out examples: ``test`` when given, else the seeded
``1 - train_fraction`` of ``examples`` (interchange trains nothing, but measuring it on the
examples DAS is measured on keeps the two rows of a site comparable). ``only_solved`` keeps, of
both, the examples the model solves (:func:`~depthscope.analyses.causal.variables.solving.solved`); the
summary's ``n_train_all`` and ``n_test_all`` count them before, ``n_train`` and ``n_test`` after.
``test_overlap`` counts the test examples that are also train examples (the same base and source,
:func:`~depthscope.analyses.causal.variables.counterfactuals.overlap`); any is logged as a warning,
as the IIA of those is not held out. The best site of each position (the summary's ``best_sites``,
the console's "best IIA") is the one of highest IIA on the test examples themselves, so its IIA is
the maximum over sites of noisy estimates, biased upward; the summary says so in
``best_site_chosen_on`` (``"test"``) and the console table in its caption.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from rich.table import Table

from depthscope.analyses.causal.erasure.config import CausalConfig
from depthscope.analyses.causal.erasure.used import causal_tests
from depthscope.analyses.causal.variables.alignment import das
from depthscope.analyses.causal.variables.config import LocalizeConfig
from depthscope.analyses.causal.variables.counterfactuals import overlap, read_counterfactuals, split_examples
from depthscope.analyses.causal.variables.iia import interchange, resid_sites
from depthscope.analyses.causal.variables.localize_plots import plot_iia, plot_three_curves
from depthscope.analyses.causal.variables.solving import solved
from depthscope.analyses.causal.variables.subspaces import save_subspaces
from depthscope.analyses.jobs.base import JobResult, Output
from depthscope.common.errors import InputError
from depthscope.probes.config import DataConfig, ExtractionConfig

TABLE, PROBES = "localize", "localize_probes"
FIGURE, THREE = "localize_iia", "localize_three_curves"
#: where the best site of a position is chosen (the summary's ``best_site_chosen_on``)
CHOSEN_ON = "test"
#: the probe side of the three curves: held-out tokens of the loss, random erasures, bootstrap resamples
PROBE_TOKENS, PROBE_CONTROLS, PROBE_BOOTSTRAP = 600, 2, 200
log = logging.getLogger("depthscope")


def _split(cfg: LocalizeConfig) -> tuple[list, list]:
    if cfg.examples is None:
        raise InputError("no examples: give --examples FILE.jsonl")
    exs = read_counterfactuals(cfg.examples)
    if cfg.test is not None:
        return exs, read_counterfactuals(cfg.test)
    return split_examples(exs, cfg.train_fraction, cfg.seed)


def _only_solved(model, train: list, test: list, cfg: LocalizeConfig) -> tuple[list, list]:
    """The train and test examples the model solves (:func:`solved`); none left in either is an error."""
    keep = [[e for e, ok in zip(part, solved(model, part, batch_size=cfg.batch_size)) if ok] for part in (train, test)]
    if not keep[0] or not keep[1]:
        raise InputError(
            f"--only-solved: the model solves {len(keep[0])} of {len(train)} train and {len(keep[1])} of "
            f"{len(test)} test examples; each part needs at least one (or use --all-examples)"
        )
    return keep[0], keep[1]


def _overlap(train: list, test: list, cfg: LocalizeConfig) -> int:
    """The test examples also in train, logged as a warning when there are any."""
    n = overlap(train, test)
    if n:
        where = f"--test {cfg.test}" if cfg.test is not None else "the split of --examples (repeated examples)"
        log.warning(
            "%d of %d test examples (%s) are also train examples (same base and source): their IIA is not held out",
            n,
            len(test),
            where,
        )
    return n


def _probes(model, sites: list[int], cfg: LocalizeConfig, progress: bool):
    """The causal tests of ``probe_task`` at the same sites (probe accuracy and ``used``)."""
    n = cfg.probe_sentences
    causal = CausalConfig(
        tasks=[cfg.probe_task],
        controls=PROBE_CONTROLS,
        bootstrap=PROBE_BOOTSTRAP,
        max_text_tokens=PROBE_TOKENS,
        data=DataConfig(max_train_sentences=n, max_test_sentences=max(n // 2, 1)),
        extraction=ExtractionConfig(sites=sites),
    )
    return causal_tests(model, causal, progress=progress).table


def localize_job(model, config: LocalizeConfig, out: Output | None = None, *, progress: bool = True) -> JobResult:
    """Interchange or DAS (``config.method``) on ``config``'s examples with ``model`` (a
    HookedModel, or a loader called once the examples are read); ``out`` None computes without
    writing. See the module docstring."""
    cfg = config
    out = out if out is not None else Output(None)
    n_before = len(out.written)
    train, test = _split(cfg)
    m = model if hasattr(model, "run") else model()
    n_all = {"n_train_all": len(train), "n_test_all": len(test)}
    if cfg.only_solved:
        train, test = _only_solved(m, train, test, cfg)
    n_overlap = _overlap(train, test, cfg)
    sites = resid_sites(m, cfg.sites)
    run_cfg = replace(cfg, progress=progress)
    res = None
    if cfg.method == "das":
        res = das(m, train, test, sites, cfg.positions, cfg.dim, boundless=cfg.boundless, config=run_cfg)
        table = res.table
    else:
        table = interchange(m, test, sites, cfg.positions, config=run_cfg)
    out.table(table, TABLE)
    tables = {TABLE: table}
    if cfg.probe_task:
        tables[PROBES] = _probes(m, sites, cfg, progress)
        out.table(tables[PROBES], PROBES)
    if res is not None and out.folder is not None:
        out.written.append(save_subspaces(list(res.subspaces.values()), out.folder / "subspaces.safetensors"))
    summary = {
        "model": m.name,
        "examples": str(cfg.examples),
        "test": str(cfg.test) if cfg.test is not None else f"split of examples ({1 - cfg.train_fraction:g})",
        "n_train": len(train),
        "n_test": len(test),
        **n_all,
        "test_overlap": n_overlap,
        "best_sites": best_sites(table),
        "best_site_chosen_on": CHOSEN_ON,
        "notes": table.attrs.get("notes", []),
        "config": cfg.to_dict(),
    }
    out.json(summary, "localize_summary")
    if cfg.plots:
        out.figure(plot_iia, table, name=FIGURE)
        if PROBES in tables:
            out.figure(plot_three_curves, table, tables[PROBES], name=THREE)
    else:  # an earlier run's figures must not pass for this run's
        out.drop(FIGURE, THREE)
    return JobResult(tables=tables, summary=summary, files=list(out.written[n_before:]))


def _best(d):
    """The row of highest IIA of one position's rows (the first in depth order on a tie)."""
    return d.loc[d.sort_values("depth")["iia"].idxmax()]


def best_sites(table) -> dict:
    """Per position: the site of highest IIA on the test examples (``label``) and that ``iia``."""
    return {
        str(pos): {"site": str(b["label"]), "iia": float(b["iia"])}
        for pos, b in ((pos, _best(d)) for pos, d in table.groupby("position", sort=False))
    }


def summary_table(table, summary: dict | None = None) -> Table:
    """Per position: the best site (its IIA and interval), the random subspace's IIA there, and the
    first site (in depth order) whose IIA reaches half of the best; a caption that the best site is
    chosen on the test examples and, with a ``summary`` of an ``only_solved`` run, how many examples
    the filter dropped."""
    t = Table("position", "method", "sites", "best IIA (site) [95%]", "random there", "first >= half best")
    n_sites = table["label"].nunique()
    notes = [f"best site chosen on the {CHOSEN_ON} examples: its IIA, the highest of {n_sites} sites', is biased up"]
    if summary and summary.get("config", {}).get("only_solved"):
        n, n_all = summary["n_train"] + summary["n_test"], summary["n_train_all"] + summary["n_test_all"]
        notes.append(
            f"--only-solved: dropped {n_all - n} of {n_all} examples the model does not solve "
            f"(train {summary['n_train']}/{summary['n_train_all']}, test {summary['n_test']}/{summary['n_test_all']})"
        )
    t.caption = "\n".join(notes)
    for pos, d in table.groupby("position", sort=False):
        d = d.sort_values("depth")
        best = _best(d)
        first = d[d["iia"] >= best["iia"] / 2].iloc[0]
        rand = "" if best["iia_random"] != best["iia_random"] else f"{best['iia_random']:.2f}"
        t.add_row(
            str(pos),
            str(best["method"]),
            str(len(d)),
            f"{best['iia']:.2f} ({best['label']}) [{best['iia_low']:.2f}, {best['iia_high']:.2f}]",
            rand,
            str(first["label"]),
        )
    return t
