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
``best_sites(table, chooser)``     per position, the site of the highest IIA on ``chooser`` (a
                                   held-out slice of train) and its IIA on the test examples
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
the console's "best IIA") is chosen on a seeded ``select_fraction`` (default 0.2) of the train
examples held out for it (DAS trains on the rest; interchange is measured on that slice too), and
its IIA (``iia``, interval, ``iia_token``) is the test examples': the choice and the estimate are
on different examples, so the estimate is not the maximum of noisy estimates. The summary says
so in ``best_site_chosen_on`` (``iia_chosen_on``: the IIA on the slice). ``select_fraction`` 0
(or a single train example) chooses on the test examples themselves, and ``best_site_chosen_on``
is then ``"test"``: that IIA is biased upward, and the console caption says so.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from rich.table import Table

from depthscope.analyses.causal.erasure.config import CausalConfig
from depthscope.analyses.causal.erasure.used import causal_tests
from depthscope.analyses.causal.variables.alignment import das, measure_subspaces
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


def _selection(train: list, cfg: LocalizeConfig) -> tuple[list, list, str]:
    """(the examples DAS trains on, those each position's best site is chosen on, the choice
    named): a seeded ``select_fraction`` of ``train`` held out for the choice, or (0, or fewer than
    2 train examples) none, the choice then made on the test examples."""
    if cfg.select_fraction == 0 or len(train) < 2:
        return train, [], CHOSEN_ON
    fit, select = split_examples(train, 1 - cfg.select_fraction, cfg.seed + 1)
    trains = "; DAS trains on the other train examples" if cfg.method == "das" else ""
    return (
        fit,
        select,
        (
            f"train slice: a seeded {cfg.select_fraction:g} of the train examples ({len(select)}) held out to choose "
            f"the site{trains}; its IIA is the test examples'"
        ),
    )


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
    fit, select, chosen_on = _selection(train, cfg)
    sites = resid_sites(m, cfg.sites)
    run_cfg = replace(cfg, progress=progress)
    res, chooser = None, None
    if cfg.method == "das":
        res = das(m, fit, test, sites, cfg.positions, cfg.dim, boundless=cfg.boundless, config=run_cfg)
        table = res.table
        if select:
            chooser = measure_subspaces(m, select, res.subspaces, config=run_cfg)
    else:
        table = interchange(m, test, sites, cfg.positions, config=run_cfg)
        if select:
            chooser = interchange(m, select, sites, cfg.positions, config=run_cfg)
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
        "n_select": len(select),
        **n_all,
        "test_overlap": n_overlap,
        "best_sites": best_sites(table, chooser),
        "best_site_chosen_on": chosen_on,
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


def best_sites(table, chooser=None) -> dict:
    """Per position: the site of highest IIA (``label``; on ``chooser``, a table of the same sites
    measured on other examples, when given, else on ``table`` itself) with its ``iia``,
    ``iia_low``, ``iia_high`` and ``iia_token`` in ``table`` (the test examples), and
    ``iia_chosen_on`` (its IIA where it was chosen)."""
    out = {}
    for pos, d in table.groupby("position", sort=False):
        pick = _best(d if chooser is None else chooser[chooser["position"] == pos])
        b = d[d["label"] == pick["label"]].iloc[0]
        cols = {k: float(b[k]) for k in ("iia", "iia_low", "iia_high", "iia_token")}
        out[str(pos)] = {"site": str(b["label"]), **cols, "iia_chosen_on": float(pick["iia"])}
    return out


def summary_table(table, summary: dict | None = None) -> Table:
    """Per position: the best site (its IIA and interval), the random subspace's IIA there, and the
    first site (in depth order) whose IIA reaches half of the best; the best site is the
    ``summary``'s (chosen on a train slice) when given, else the highest on ``table``; a caption that
    says where it was chosen and, with a ``summary`` of an ``only_solved`` run, how many examples
    the filter dropped."""
    t = Table("position", "method", "sites", "best IIA (site) [95%]", "random there", "first >= half best")
    n_sites = table["label"].nunique()
    chosen = (summary or {}).get("best_sites")
    on = (summary or {}).get("best_site_chosen_on", CHOSEN_ON)
    biased = f"best site chosen on the {CHOSEN_ON} examples: its IIA, the highest of {n_sites} sites', is biased up"
    notes = [biased if on == CHOSEN_ON else f"best site chosen on a {on}"]
    if summary and summary.get("config", {}).get("only_solved"):
        n, n_all = summary["n_train"] + summary["n_test"], summary["n_train_all"] + summary["n_test_all"]
        notes.append(
            f"--only-solved: dropped {n_all - n} of {n_all} examples the model does not solve "
            f"(train {summary['n_train']}/{summary['n_train_all']}, test {summary['n_test']}/{summary['n_test_all']})"
        )
    t.caption = "\n".join(notes)
    for pos, d in table.groupby("position", sort=False):
        d = d.sort_values("depth")
        best = _best(d) if not chosen else d[d["label"] == chosen[str(pos)]["site"]].iloc[0]
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
