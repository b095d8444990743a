"""depthscope.probes: labelled data and classifiers (Tenney-style probing at every site).

Which depth of a model makes a linguistic property linearly decodable? Tenney, Das and
Pavlick (2019) answered it for BERT with edge probing, scalar mixing weights and cumulative
scoring; this package does the same for decoders at sublayer resolution (embed, after each
attention sublayer, after each MLP sublayer).

Public API
----------
``run_probes(model, tasks, train, test, dev=None, *, config=ProbeConfig(), extraction=ExtractionConfig(),
data=DataConfig(), progress=True, **overrides) -> ProbeResults``
    ``overrides``: any field of the three configuration objects by name (``max_epochs=60``,
    ``pooling="mean"``, ``max_train_sentences=200``); an unknown name is an ``InputError``.
    ``.by_site`` columns: task, site, label, layer, sublayer, depth, accuracy, macro_f1,
    control_accuracy, selectivity, train_accuracy, l2, probe, pooling, n_train, n_test,
    majority_accuracy, converged, epochs (+ mdl_online_bits, mdl_uniform_bits, mdl_compression with ``mdl=True``).
    ``.summary`` columns: task, expected_layer_delta (+ _lo/_hi: 95% bootstrap interval over test
    examples and fold draws; from the soft accuracy, the mean probability of the gold label),
    expected_layer_delta_hard (+ _lo/_hi: the same from the argmax accuracy), expected_layer_mix (E_s; + _lo/_hi:
    its range over refits without each of ``mix_folds`` folds), mix_spread (exp entropy of the mix
    weights, in sites), best_label,
    best_accuracy, n_train, n_test, mix_accuracy, mix_soft_accuracy, best_site, best_depth, best_macro_f1,
    best_selectivity, max_selectivity, n_layers, relative_depth_delta, relative_depth_mix,
    relative_depth_best, majority_accuracy, n_classes, n_test_unseen_labels,
    n_skipped_train, n_skipped_test, kind, probe, pooling, precision, n_overlap_dropped, context,
    total_delta, total_delta_se, expected_layer_delta_meaningful, expected_layer_delta_note (why
    not), l2, l2_chosen_on, l2_heldout_accuracy, l2_search_not_converged (probes of the penalty
    search left at the cap), converged, hit_max_epochs, n_not_converged,
    epochs_sites, epochs_cumulative (the stacking's passes), epochs_mix, mix_starts, mix_note (two scalar-mix
    optima the data cannot tell apart, else empty), max_epochs, solver.
    ``.mixing`` columns: task, site, label, layer, sublayer, depth, mix_weight,
    cumulative_score (soft accuracy), cumulative_accuracy, cumulative_macro_f1, delta (of the
    cumulative_score), gamma.
``ProbeConfig``, ``ExtractionConfig``, ``DataConfig``: the settings and their (only) defaults.
``prepare_task(...) -> TaskData``: one task's labels and standardised features, no fitting.
``probe_sites(td, frame, config, FitOptions(pooling)) -> SiteProbes``: ``run_probes``'s per-site
    probes of a prepared task (the penalty, the probes, their ``by_site`` rows), for analyses that
    report the project's probe beside their own (sparse probing's dense probe).
``sample_data() -> dict``: paths of the bundled UD excerpts (``ewt_train``, ``ewt_test``,
    ``gum_train``, ``gum_test``).
``word_features(model, sentences, sites=None, pooling="last", standardize=False) -> WordFeatures``:
    raw float32 features ``[sites, n_words, d_model]`` and an index table (sentence, word, form,
    gold columns) from a CoNLL-U path, parsed sentences or lists of words, for your own probes.
``read_conllu``, ``build_task``, ``control_labels``, ``expected_layer_delta``,
``expected_layer_mix``, ``online_codelength``, ``BatchedProbe``, ``Features`` (and ``SpanRows``,
its resident pair features held once per span), ``train_probe``,
``predict``, ``accuracy``, ``macro_f1``, ``resolve_precision``: the building blocks.

Rooms (sub-packages), lowest first: ``corpora`` (CoNLL-U and jiant readers, tasks, spans to
tokens), ``store`` (activation extraction, shards, features, ``word_features``), ``solvers`` (the
batched probe and the numerics that fit it). The science sits at the top: ``config`` (settings),
``encoding`` (labels and features of a task), ``fitting`` (one task's probes), ``mixing`` (Tenney's
summaries), ``mdl``, ``metrics``, ``summaries`` (table rows), ``run`` (``run_probes``).

Tables and figures (``probes_by_site``, ``probes_summary``, ``probes_mixing``,
``probes_accuracy.png``, ``probes_tenney.png``) are written by the probe job,
``depthscope.analyses.jobs.probe.run_probe_job``; this package never imports ``analyses``.
Command line: ``depthscope probe --help``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

_EXPORTS = {
    "POOLINGS": "store.activations",
    "SpanStore": "store.activations",
    "SpanExtraction": "store.activations",
    "extract_spans": "store.activations",
    "BatchedProbe": "solvers.classifiers",
    "L2_GRID": "config",
    "L2_LADDER": "config",
    "DataConfig": "config",
    "ExtractionConfig": "config",
    "ProbeConfig": "config",
    "ConlluError": "corpora.conllu",
    "Corpus": "corpora.conllu",
    "Mention": "corpora.conllu",
    "Sentence": "corpora.conllu",
    "Word": "corpora.conllu",
    "parse_conllu_text": "corpora.conllu",
    "read_conllu": "corpora.conllu",
    "resolve_precision": "solvers.cpu",
    "TaskData": "encoding",
    "Features": "store.features",
    "VOITA_FRACTIONS": "mdl",
    "online_codelength": "mdl",
    "accuracy": "metrics",
    "macro_f1": "metrics",
    "deltas": "mixing",
    "expected_layer_delta": "mixing",
    "expected_layer_delta_interval": "mixing",
    "expected_layer_mix": "mixing",
    "fit_cumulative": "mixing",
    "ProbeResults": "run",
    "prepare_task": "run",
    "FitOptions": "fitting",
    "SiteProbes": "fitting",
    "probe_sites": "fitting",
    "run_probes": "run",
    "PIPELINE_ORDER": "corpora.tasks",
    "TaskExamples": "corpora.tasks",
    "build_task": "corpora.tasks",
    "control_labels": "corpora.tasks",
    "load_corpus": "corpora.tasks",
    "read_jiant": "corpora.tasks",
    "predict": "solvers.training",
    "train_probe": "solvers.training",
    "TrainSettings": "solvers.base",
    "Resident": "store.features",
    "SpanRows": "store.span_rows",
    "WordFeatures": "store.words",
    "word_features": "store.words",
}


_SUBMODULES = {
    "config",
    "corpora",
    "data",
    "encoding",
    "fitting",
    "mdl",
    "metrics",
    "mixing",
    "run",
    "solvers",
    "store",
    "summaries",
}


def __getattr__(name: str):
    """Names are imported on first use (PEP 562), so ``import depthscope.probes.config`` (the
    command line's option defaults) stays cheap: no torch until a probe runs."""
    mod = _EXPORTS.get(name)
    if mod is None:
        if name in _SUBMODULES:  # ``depthscope.probes.run`` without importing it first
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


DATA_DIR = Path(__file__).parent / "data"


def sample_data() -> dict:
    """Paths of the bundled Universal Dependencies v2.16 excerpts (see data/README.md):
    ``ewt_train`` (~300 sentences), ``ewt_test`` (~150), ``gum_train`` (~200, whole
    documents with entity/coreference annotation), ``gum_test`` (~100)."""
    paths = {
        "ewt_train": DATA_DIR / "ewt_sample_train.conllu",
        "ewt_test": DATA_DIR / "ewt_sample_test.conllu",
        "gum_train": DATA_DIR / "gum_sample_train.conllu",
        "gum_test": DATA_DIR / "gum_sample_test.conllu",
    }
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"bundled probing samples missing: {missing}")
    return paths


__all__ = [
    "run_probes",
    "ProbeConfig",
    "ExtractionConfig",
    "DataConfig",
    "resolve_precision",
    "PIPELINE_ORDER",
    "ProbeResults",
    "prepare_task",
    "probe_sites",
    "SiteProbes",
    "FitOptions",
    "TaskData",
    "sample_data",
    "read_conllu",
    "parse_conllu_text",
    "read_jiant",
    "load_corpus",
    "Corpus",
    "Sentence",
    "Word",
    "Mention",
    "ConlluError",
    "build_task",
    "TaskExamples",
    "control_labels",
    "extract_spans",
    "SpanStore",
    "SpanExtraction",
    "POOLINGS",
    "BatchedProbe",
    "Features",
    "SpanRows",
    "train_probe",
    "TrainSettings",
    "Resident",
    "predict",
    "accuracy",
    "macro_f1",
    "expected_layer_delta",
    "expected_layer_delta_interval",
    "expected_layer_mix",
    "deltas",
    "fit_cumulative",
    "online_codelength",
    "VOITA_FRACTIONS",
    "L2_GRID",
    "L2_LADDER",
    "word_features",
    "WordFeatures",
]
