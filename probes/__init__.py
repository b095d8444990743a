"""depthscope.probes: labelled data and classifiers (Tenney-style probing at every site).

Which depth of a model makes a linguistic property linearly decodable? Tenney, Das and
Pavlick (2019) answered it for BERT with edge probing, scalar mixing weights and cumulative
scoring; this package does the same for decoders at sublayer resolution (embed, after each
attention sublayer, after each MLP sublayer).

Public API
----------
``run_probes(model, tasks, train, test, dev=None, *, probe="linear", pooling="last",
sites=None, max_train_sentences=None, max_test_sentences=None, store_dir=None, seed=0,
mdl=False, progress=True, ...) -> ProbeResults``
    ``.by_site`` columns: task, site, label, layer, sublayer, depth, accuracy, macro_f1,
    control_accuracy, selectivity, train_accuracy, l2, probe, pooling, n_train, n_test
    (+ mdl_online_bits, mdl_uniform_bits, mdl_compression with ``mdl=True``).
    ``.summary`` columns: task, expected_layer_delta (+ _lo/_hi: 95% bootstrap interval over test
    examples), expected_layer_mix, best_label,
    best_accuracy, n_train, n_test, mix_accuracy, best_site, best_depth, best_macro_f1,
    best_selectivity, max_selectivity, n_layers, relative_depth_delta, relative_depth_mix,
    relative_depth_best, majority_accuracy, n_classes, n_test_unseen_labels,
    n_skipped_train, n_skipped_test, kind, probe, pooling, n_overlap_dropped, context.
    ``.mixing`` columns: task, site, label, layer, sublayer, depth, mix_weight,
    cumulative_score, cumulative_macro_f1, delta, gamma.
    ``.write(out_dir)`` writes probes_by_site / probes_summary / probes_mixing (.csv +
    .parquet) and the figures.
``sample_data() -> dict``: paths of the bundled UD excerpts (``ewt_train``, ``ewt_test``,
    ``gum_train``, ``gum_test``).
``word_features(model, sentences, *, sites=None, pooling="last", standardize=False) -> WordFeatures``:
    raw float32 features ``[sites, n_words, d_model]`` and an index table (sentence, word, form,
    gold columns) from a CoNLL-U path, parsed sentences or lists of words, for your own probes.
``read_conllu``, ``build_task``, ``control_labels``, ``expected_layer_delta``,
``expected_layer_mix``, ``online_codelength``, ``BatchedProbe``: the building blocks.

Plots (``depthscope.analyses.plots.probes``): ``plot_probe_curves(by_site, path)`` and
``plot_tenney(summary, mixing, path)``. Command line: ``depthscope probe --help``.
"""

from __future__ import annotations

from pathlib import Path

from .activations import POOLINGS, SpanStore, extract_spans
from .classifiers import BatchedProbe, Features, accuracy, macro_f1, predict, train_probe
from .conllu_io import ConlluError, Corpus, Mention, Sentence, Word, parse_conllu_text, read_conllu
from .features import WordFeatures, word_features
from .mdl import VOITA_FRACTIONS, online_codelength
from .mixing import deltas, expected_layer_delta, expected_layer_delta_interval, expected_layer_mix, fit_cumulative
from .run import L2_GRID, ProbeResults, TaskData, prepare_task, run_probes
from .tasks import TaskExamples, build_task, control_labels, load_corpus, read_jiant

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
    "ProbeResults",
    "prepare_task",
    "TaskData",
    "sample_data",
    "word_features",
    "WordFeatures",
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
    "POOLINGS",
    "BatchedProbe",
    "Features",
    "train_probe",
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
]
