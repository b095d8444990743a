"""Circuits as graphs: MIB's graph and edge counts, EAP scores and exact circuit evaluation against
plain-torch references on transformers models (tests/graph_refs.py), faithfulness, the command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from depthscope.analyses.circuits import edge_attribution, evaluate_circuit
from depthscope.analyses.circuits.edges.evaluate import CircuitEvaluator
from depthscope.analyses.circuits.edges.faithfulness import areas, circuit_faithfulness
from depthscope.analyses.circuits.edges.graph import circuit_graph
from depthscope.analyses.circuits.pairs import PromptPair
from depthscope.common.errors import InputError
from tests import graph_refs as ref
from tests.conftest import make_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "gpt2", "gpt_neox"]


# ----------------------------------------------------------------------------- the graph
def test_mib_edge_counts_from_configs():
    """MIB's edge counts, from configs alone (no weights)."""
    import transformers as tf

    gpt2 = tf.GPT2Config(n_layer=12, n_head=12, n_embd=768)
    qwen = tf.Qwen2Config(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896)
    smol = tf.LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert circuit_graph(gpt2).n_edges == 32491
    assert circuit_graph(qwen).n_edges == 179749
    assert circuit_graph(smol).n_edges == 123211


def test_graph_of_model_matches_its_config(tiny_factory):
    model = tiny_factory("llama")
    g = circuit_graph(model)
    # 3 layers, 4 query heads: senders embed + 3 * (4 + 1); receivers 3 * (3 * 4 + 1) + logits
    assert len(g.senders) == 16 and len(g.receivers) == 40
    assert g.n_edges == int(g.mask.sum())
    assert g.n_edges == circuit_graph(make_tiny("llama").config).n_edges


# ----------------------------------------------------------------------------- data
def _pairs(vocab: int, n: int = 2, length: int = 6, seed: int = 0):
    """(PromptPairs of token ids, the same as (clean, corrupted, target, foil) tensors) that differ
    from position 2 on (so the skipped prefix is exercised)."""
    g = torch.Generator().manual_seed(seed)
    out, raw = [], []
    for _ in range(n):
        clean = torch.randint(5, vocab, (length,), generator=g)
        corrupted = clean.clone()
        corrupted[2:] = torch.randint(5, vocab, (length - 2,), generator=g)
        t, f = (int(x) for x in torch.randint(5, vocab, (2,), generator=g))
        out.append(PromptPair(clean.tolist(), corrupted.tolist(), t, f))
        raw.append((clean[None], corrupted[None], t, f))
    return out, raw


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer):
    """family -> (HookedModel, the transformers model it wraps)."""
    from depthscope.hooks import load_model

    cache = {}

    def get(family):
        if family not in cache:
            n = len(tiny_tokenizer)  # two copies of one seeded model: the engine's and the reference's
            cache[family] = (
                load_model(make_tiny(family, vocab_size=n), tokenizer=tiny_tokenizer),
                make_tiny(family, vocab_size=n),
            )
        return cache[family]

    return get


# ----------------------------------------------------------------------------- EAP
@pytest.mark.parametrize("family", FAMILIES)
def test_eap_matches_brute_force_reference(tiny, family):
    model, hf = tiny(family)
    pairs, raw = _pairs(hf.config.vocab_size)
    df = edge_attribution(model, pairs, "eap")
    g = circuit_graph(model)
    assert len(df) == g.n_edges
    want = ref.reference_scores(hf, raw, g)
    got = {(s, r): v for s, r, v in zip(df["sender"], df["receiver"], df["score"])}
    keys = sorted(want)
    a, b = np.array([got[k] for k in keys]), np.array([want[k] for k in keys])
    assert np.abs(b).max() > 1e-3  # the scores are not all zero
    np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max() + 1e-6, rtol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_eap_ig_matches_brute_force_reference(tiny, family):
    """EAP-IG's gradients averaged along the corrupted-to-clean input path, against plain torch;
    and they are other scores than EAP's."""
    model, hf = tiny(family)
    pairs, raw = _pairs(hf.config.vocab_size, n=1)
    ig = edge_attribution(model, pairs, "eap-ig", steps=3)
    want = ref.reference_ig_scores(hf, raw, circuit_graph(model), steps=3)
    got = {(s, r): v for s, r, v in zip(ig["sender"], ig["receiver"], ig["score"])}
    keys = sorted(want)
    a, b = np.array([got[k] for k in keys]), np.array([want[k] for k in keys])
    assert np.abs(b).max() > 1e-3
    np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max() + 1e-6, rtol=1e-3)
    eap = edge_attribution(model, pairs, "eap")
    assert not np.allclose(eap["score"], ig["score"])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_eap_ig_under_zero_and_mean_ablation_matches_plain_torch(tiny, family):
    """EAP-IG under zero or mean ablation: the path runs from the ablated token embeddings (zero;
    the mean token embedding from position 1 on) to the clean ones, and the differences are the
    ablation's, against plain torch."""
    from depthscope.analyses.circuits.edges.ablation import sender_means

    model, hf = tiny(family)
    pairs, raw = _pairs(hf.config.vocab_size, n=1)
    mean_pairs, mean_raw = _pairs(hf.config.vocab_size, n=3, seed=5)
    g = circuit_graph(model)
    values = ref.mean_writes(hf, [c for c, _, _, _ in mean_raw], 6)
    token_mean = values[0] - ref.position_embedding(hf, 6)

    def mean_start(c):
        e = ref.token_embedding(hf, c).clone()
        e[1:] = token_mean[1:]
        return e[None]

    cases = [
        ("zero", lambda c: _zero_writes(hf, 6, len(g.senders)), lambda c: torch.zeros(1, 6, hf.config.hidden_size)),
        (sender_means(model, mean_pairs), lambda c: _clean_at_0(hf, c, values), mean_start),
    ]
    for ablation, ablated, start in cases:
        df = edge_attribution(model, pairs, "eap-ig", steps=2, ablation=ablation)
        want = ref.reference_ig_scores(hf, raw, g, 2, ablated=ablated, start=start)
        got = {(s, r): v for s, r, v in zip(df["sender"], df["receiver"], df["score"])}
        keys = sorted(want)
        a, b = np.array([got[k] for k in keys]), np.array([want[k] for k in keys])
        assert np.abs(b).max() > 1e-3
        np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max() + 1e-6, rtol=1e-3)


def test_unequal_lengths_are_refused_naming_the_pair(tiny):
    model, hf = tiny("llama")
    pairs, _ = _pairs(hf.config.vocab_size)
    bad = PromptPair([7, 8, 9, 10], [7, 8, 9], 11, 12)
    with pytest.raises(InputError, match="pair 2.*4 tokens.*3"):
        edge_attribution(model, [*pairs, bad])
    with pytest.raises(InputError, match="pair 2"):
        evaluate_circuit(model, [*pairs, bad], [])


# ----------------------------------------------------------------------------- evaluation
@pytest.mark.parametrize("family", FAMILIES)
def test_all_edges_is_clean_and_none_is_corrupted(tiny, family):
    model, hf = tiny(family)
    pairs, raw = _pairs(hf.config.vocab_size)
    g = circuit_graph(model)
    ev = CircuitEvaluator(model, pairs)
    full = ev.metrics(g.mask.copy())
    none = ev.metrics(np.zeros_like(g.mask))
    with torch.no_grad():
        clean = [float(ref.metric(hf(c).logits, t, f)[0]) for c, _, t, f in raw]
        corrupted = [float(ref.metric(hf(k).logits, t, f)[0]) for _, k, t, f in raw]
    np.testing.assert_allclose(full, clean, atol=1e-4)
    np.testing.assert_allclose(none, corrupted, atol=2e-4)
    assert np.abs(np.array(clean) - corrupted).max() > 2e-2  # the two ends differ


@pytest.mark.parametrize("receiver", ["1.q.3", "2.k.1", "1.v.2", "2.mlp_in", "logits"])
def test_one_ablated_edge_matches_plain_torch(tiny, receiver):
    model, hf = tiny("llama")  # grouped: query heads of a group read different k/v inputs
    pairs, raw = _pairs(hf.config.vocab_size, n=1)
    g = circuit_graph(model)
    sender = "0.heads.1"
    kept = g.mask.copy()
    kept[g.sender_index[sender], g.receiver_index[receiver]] = False
    got = CircuitEvaluator(model, pairs).metrics(kept)[0]
    c, k, t, f = raw[0]
    want = ref.ablated_metric(hf, c, k, t, f, g, sender, receiver)
    with torch.no_grad():
        clean = float(ref.metric(hf(c).logits, t, f)[0])
    assert abs(want - clean) > 1e-5  # the edge matters
    assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("density", [0.1, 0.7])
def test_random_circuits_match_the_definition(tiny, family, density):
    """Random circuits (sparse: the kept side is summed; dense: the cut side) against the
    definition computed receiver by receiver in plain torch."""
    model, hf = tiny(family)
    pairs, raw = _pairs(hf.config.vocab_size, n=2)
    g = circuit_graph(model)
    rng = np.random.default_rng(1)
    kept = g.mask & (rng.random(g.mask.shape) < density)
    got = CircuitEvaluator(model, pairs).metrics(kept)
    want = [ref.circuit_metric(hf, c, k, t, f, g, kept) for c, k, t, f in raw]
    np.testing.assert_allclose(got, want, atol=2e-4)


def _zero_writes(hf, n: int, n_senders: int) -> list[torch.Tensor]:
    """Zero ablation's values by hand: zero, but ``embed`` (the token embedding alone) leaves the
    position embedding of GPT-2 in place."""
    d = hf.config.hidden_size
    return [ref.position_embedding(hf, n)] + [torch.zeros(n, d) for _ in range(n_senders - 1)]


def _clean_at_0(hf, clean, values):
    """Mean ablation's values for one prompt: position 0 keeps the prompt's own (clean) write."""
    own = ref.sender_writes(ref.ungroup(hf), clean)
    return [torch.cat([o[:1], v[1:]]) for o, v in zip(own, values)]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("aligned", [True, False])
def test_mean_ablation_matches_plain_torch(tiny, family, aligned):
    """Mean ablation against a forward written by hand with the means substituted: the mean taken
    from other prompts (per position when they have the evaluated length, else over positions
    1 ..), position 0 kept clean, ``embed`` the token embedding alone (GPT-2's positions stay)."""
    from depthscope.analyses.circuits.edges.ablation import sender_means

    model, hf = tiny(family)
    pairs, raw = _pairs(hf.config.vocab_size, n=2)
    mean_pairs, mean_raw = _pairs(hf.config.vocab_size, n=3, length=6 if aligned else 8, seed=5)
    means = sender_means(model, mean_pairs)
    assert means.positional(6) is aligned and means.n_prompts == 3
    g = circuit_graph(model)
    kept = g.mask & (np.random.default_rng(2).random(g.mask.shape) < 0.5)
    got = CircuitEvaluator(model, pairs, means).metrics(kept)
    values = ref.mean_writes(hf, [c for c, _, _, _ in mean_raw], 6)
    want = [ref.circuit_metric(hf, c, k, t, f, g, kept, ablated=_clean_at_0(hf, c, values)) for c, k, t, f in raw]
    np.testing.assert_allclose(got, want, atol=2e-4)
    with torch.no_grad():
        clean = [float(ref.metric(hf(c).logits, t, f)[0]) for c, _, t, f in raw]
    assert np.abs(np.array(want) - clean).max() > 1e-2  # the ablation changes the metric


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_zero_ablation_matches_plain_torch(tiny, family):
    model, hf = tiny(family)
    pairs, raw = _pairs(hf.config.vocab_size, n=2)
    g = circuit_graph(model)
    kept = g.mask & (np.random.default_rng(2).random(g.mask.shape) < 0.5)
    got = CircuitEvaluator(model, pairs, "zero").metrics(kept)
    values = _zero_writes(hf, 6, len(g.senders))
    want = [ref.circuit_metric(hf, c, k, t, f, g, kept, ablated=values) for c, k, t, f in raw]
    np.testing.assert_allclose(got, want, atol=2e-4)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_eap_scores_the_differences_of_mean_and_zero_ablation(tiny, family):
    """Under zero ablation an edge's score is sum_p (0 - a_u(clean)) . dm/dx_v, under mean
    ablation sum_p (mean - a_u(clean)) . dm/dx_v with position 0 clean, the means of other prompts:
    the differences the evaluation puts in (EAP-IG's convention), against plain torch."""
    from depthscope.analyses.circuits.edges.ablation import sender_means

    model, hf = tiny(family)
    pairs, raw = _pairs(hf.config.vocab_size, n=1)
    mean_pairs, mean_raw = _pairs(hf.config.vocab_size, n=3, seed=5)
    g = circuit_graph(model)
    values = ref.mean_writes(hf, [c for c, _, _, _ in mean_raw], 6)
    cases = {
        "zero": ("zero", lambda c: _zero_writes(hf, c.shape[1], len(g.senders))),
        "mean": (sender_means(model, mean_pairs), lambda c: _clean_at_0(hf, c, values)),
    }
    got_all = {}
    for name, (ablation, ablated) in cases.items():
        df = edge_attribution(model, pairs, "eap", ablation=ablation)
        assert df.attrs["ablation"] == name
        want = ref.reference_scores(hf, raw, g, ablated=ablated)
        got = {(s, r): v for s, r, v in zip(df["sender"], df["receiver"], df["score"])}
        keys = sorted(want)
        a, b = np.array([got[k] for k in keys]), np.array([want[k] for k in keys])
        assert np.abs(b).max() > 1e-3
        np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max() + 1e-6, rtol=1e-3)
        got_all[name] = a
    cf = edge_attribution(model, pairs, "eap")
    assert not np.allclose(got_all["zero"], got_all["mean"]) and not np.allclose(got_all["mean"], cf["score"])


def test_evaluate_circuit_table(tiny):
    model, hf = tiny("gpt2")
    pairs, _ = _pairs(hf.config.vocab_size)
    df = evaluate_circuit(model, pairs, [("embed", "logits"), ("0.heads.0", "1.q.2")])
    # pruned: 0.heads.0 has no input edge and 1.heads.2 no output edge, so only embed -> logits stays
    assert list(df["n_edges"].unique()) == [1] and list(df["n_edges_given"].unique()) == [2]
    whole = evaluate_circuit(model, pairs, [("embed", "logits"), ("0.heads.0", "1.q.2")], prune=False)
    assert list(whole["n_edges"].unique()) == [2]
    assert set(df.columns) >= {"pair", "metric", "clean_metric", "corrupted_metric", "ablation"}
    with pytest.raises(InputError):
        evaluate_circuit(model, pairs, [("1.heads.0", "0.q.2")])  # no edge: the sender is downstream


def test_evaluate_circuit_takes_its_own_edge_table_back(tiny):
    """A table with ``in_circuit`` is the circuit of its marked rows (the job's edges.parquet), pruned
    as the curve prunes; without the column the table is taken whole."""
    from depthscope.analyses.circuits.edges.faithfulness import edge_scores_of, top_circuit

    model, hf = tiny("llama")
    pairs, _ = _pairs(hf.config.vocab_size)
    edges = edge_attribution(model, pairs, "eap")
    g = circuit_graph(model)
    scores = edge_scores_of(g, edges)
    unpruned = top_circuit(g, scores, 40, pruned=False)
    s, r = g.edge_index
    edges["in_circuit"] = unpruned[s, r]
    got = evaluate_circuit(model, pairs, edges)
    want = CircuitEvaluator(model, pairs).metrics(top_circuit(g, scores, 40))
    np.testing.assert_allclose(got["metric"], want, atol=1e-6)
    assert got.attrs["n_edges"] == int(top_circuit(g, scores, 40).sum()) < 40 == got.attrs["n_edges_given"]
    assert got["metric"].to_numpy() != pytest.approx(got["clean_metric"].to_numpy())  # not the whole model
    whole = evaluate_circuit(model, pairs, edges.drop(columns="in_circuit"))
    np.testing.assert_allclose(whole["metric"], whole["clean_metric"], atol=1e-4)
    assert whole.attrs["n_edges"] == g.n_edges
    with pytest.raises(InputError, match="in_circuit"):
        evaluate_circuit(model, pairs, edges.assign(in_circuit=1.5))


# ----------------------------------------------------------------------------- faithfulness
def test_areas_of_a_known_curve():
    """Trapezoids over the sizes above k = 0 (k = 0 is shown, not integrated)."""
    cpr, cmd = areas([0.0, 0.25, 0.5, 1.0], [0.3, 0.0, 1.0, 1.0])
    assert cpr == pytest.approx(0.25 * 0.5 + 0.5 * 1.0)
    assert cmd == pytest.approx(0.25 * 0.5)


def test_faithfulness_ends_and_random_band(tiny):
    """The ends f(0) = 0 and f(100 %) = 1 are the model's own runs: the metrics f divides by are
    the clean and the corrupted runs of plain torch (counterfactual ablation of every edge)."""
    model, hf = tiny("llama")
    pairs, raw = _pairs(hf.config.vocab_size)
    edges = edge_attribution(model, pairs, "eap")
    curve = circuit_faithfulness(model, pairs, edges, random_draws=2)
    assert list(curve["k"]) == [0, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100]
    with torch.no_grad():
        clean = np.mean([float(ref.metric(hf(c).logits, t, f)[0]) for c, _, t, f in raw])
        corrupted = np.mean([float(ref.metric(hf(k).logits, t, f)[0]) for _, k, t, f in raw])
    assert curve.attrs["full_metric"] == pytest.approx(clean, abs=1e-4)
    assert curve.attrs["empty_metric"] == pytest.approx(corrupted, abs=2e-4)
    assert curve["metric"].iloc[0] == pytest.approx(corrupted, abs=2e-4)
    assert curve["metric"].iloc[-1] == pytest.approx(clean, abs=1e-4)
    assert curve["f"].iloc[0] == pytest.approx(0.0) and curve["f"].iloc[-1] == pytest.approx(1.0)
    assert curve["f_random"].notna().all()
    assert np.isfinite([curve.attrs["cpr"], curve.attrs["cmd"], curve.attrs["cpr_random"]]).all()


# ----------------------------------------------------------------------------- the command
def test_circuit_command_writes_its_outputs(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from tests.conftest import run_cli

    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"clean": "the cat sat on the mat", "corrupted": "the dog sat on the mat", "target": " mat", "foil": " cat"},
        {"clean": "the dog ran to the park", "corrupted": "the cat ran to the park", "target": " mat", "foil": " cat"},
    ]
    pairs.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    args = ["circuit", "--pairs", pairs, "--model", tiny_llama_dir, "--method", "eap", "--out", out]
    code, stdout, stderr = run_cli([*args, "--random-draws", "1", "--bootstrap", "2"], monkeypatch, capsys)
    assert code == 0, stderr
    names = {p.name for p in out.iterdir()}
    want = ["edges.parquet", "edges.csv", "faithfulness.parquet", "circuit_summary.json", "circuit_graph.json"]
    assert set(want + ["circuit_mib.json", "circuit.html"]) <= names, names
    assert any(n.endswith(".png") for n in names) and any(n.endswith(".svg") for n in names)
    import pandas as pd

    edges = pd.read_parquet(out / "edges.parquet")
    assert len(edges) == circuit_graph(make_tiny("llama").config).n_edges
    assert len(pd.read_parquet(out / "faithfulness.parquet")) == 11
    page = (out / "circuit.html").read_text().replace("http://www.w3.org/2000/svg", "")  # the SVG namespace
    assert "<script" in page and "http" not in page  # self-contained: nothing fetched


def test_circuit_command_refuses_unequal_lengths(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from tests.conftest import run_cli

    pairs = tmp_path / "pairs.jsonl"
    row = {"clean": "the cat sat on the mat", "corrupted": "the cat sat", "target": " mat", "foil": " cat"}
    pairs.write_text(json.dumps(row))
    args = ["circuit", "--pairs", pairs, "--model", tiny_llama_dir, "--out", tmp_path / "out", "--in-sample"]
    code, _, stderr = run_cli(args, monkeypatch, capsys)
    assert code == 2 and "pair 0" in stderr and "same number of tokens" in stderr
    assert "Traceback" not in stderr


def test_interactive_page_works_in_a_headless_browser(tiny, tmp_path):
    """The page opened from disk in headless Chromium: its script runs without network, draws the
    edges and shows an edge's sender, receiver and score when hovered (``#selftest``)."""
    import shutil
    import subprocess

    from depthscope.analyses.circuits import circuit_html

    browser = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no headless browser (apt-get install -y chromium)")
    model, hf = tiny("llama")
    pairs, _ = _pairs(hf.config.vocab_size)
    edges = edge_attribution(model, pairs, "eap")
    page = circuit_html(edges, tmp_path / "circuit.html", n_edges=20)
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.resolve().as_uri() + "#selftest"]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert 'data-edges="20"' in dom, dom[-2000:]
    top = edges.reindex(edges["score"].abs().sort_values(ascending=False).index).iloc[0]
    import re

    tip = re.search(r'data-selftest="([^"]*)"', dom)
    assert tip is not None, dom[-2000:]
    assert tip.group(1).strip(), "the hovered edge's tooltip is empty"
    assert any(name in tip.group(1) for name in edges["sender"].unique()), tip.group(1)
    assert str(top["sender"]) in dom


def test_drawn_circuit_is_never_empty_when_a_small_one_holds_edges(tmp_path):
    """Without a faithful circuit of at most 500 edges, the drawing takes the most faithful size
    that still holds edges after pruning (the top 100 edges may prune to none)."""
    import pandas as pd

    from depthscope.analyses.jobs.circuit import _drawn
    from depthscope.analyses.jobs.configs import CircuitConfig

    (tmp_path / "p.jsonl").write_text('{"clean": "a", "corrupted": "b"}')
    config = CircuitConfig(pairs=str(tmp_path / "p.jsonl"), in_sample=True)
    curve = pd.DataFrame(
        {"n_edges": [0, 123, 246, 616, 1232], "n_edges_pruned": [0, 0, 181, 503, 1099], "f": [0, 0, 0.58, 0.72, 0.9]}
    )
    n, why = _drawn(curve, config)
    assert n == 246 and "most faithful" in why
    n, why = _drawn(curve.assign(n_edges_pruned=[0, 0, 0, 503, 1099]), config)
    assert n == 100 and "top 100" in why


@pytest.mark.parametrize(
    "row, reason",
    [
        (
            {"clean": "the cat sat", "corrupted": "the cat sat", "target": " mat", "foil": " cat"},
            "prompts are the same",
        ),
        ({"clean": "the cat sat", "corrupted": "the dog sat", "target": " mat", "foil": " mat"}, "target and the foil"),
    ],
)
def test_circuit_command_refuses_pairs_that_contrast_nothing(
    tiny_llama_dir, tmp_path, monkeypatch, capsys, row, reason
):
    """A pair with nothing to contrast is refused by its line, before any model loads (it ended in a
    pandas traceback: every f NaN)."""
    from tests.conftest import run_cli

    good = {"clean": "the cat sat on the mat", "corrupted": "the dog sat on the mat", "target": " mat", "foil": " cat"}
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(r) for r in (good, row)))
    args = ["circuit", "--pairs", pairs, "--model", tiny_llama_dir, "--out", tmp_path / "out"]
    code, _, stderr = run_cli(args, monkeypatch, capsys)
    assert code == 2 and "pairs.jsonl:2" in stderr and reason in stderr, stderr
    assert "Traceback" not in stderr


# ----------------------------------------------------------------------------- held out, baselines, MIB's signs
def test_split_pairs_is_seeded_disjoint_and_sized():
    from depthscope.analyses.circuits.pairs import split_pairs

    pairs = [PromptPair(f"a {i}", f"b {i}", " x", " y") for i in range(9)]
    train, held = split_pairs(pairs, 0.5, seed=3)
    assert len(train) == 4 and len(held) == 5  # round(4.5) = 4
    assert {p.clean for p in train}.isdisjoint({p.clean for p in held})
    assert {p.clean for p in train} | {p.clean for p in held} == {p.clean for p in pairs}
    assert split_pairs(pairs, 0.5, seed=3) == (train, held)
    assert split_pairs(pairs, 0.5, seed=4) != (train, held)
    assert len(split_pairs(pairs[:2], 0.99)[1]) == 1  # at least one held out
    with pytest.raises(InputError, match="at least 2 pairs"):
        split_pairs(pairs[:1])


def test_random_circuits_match_the_top_circuits_pruned_size(tiny):
    """The baseline draws circuits of the top circuit's size *after* pruning (drawn at the unpruned
    size they pruned to nothing, and f_random was 0 by construction)."""
    from depthscope.analyses.circuits.edges.faithfulness import random_circuit

    model, hf = tiny("llama")
    pairs, _ = _pairs(hf.config.vocab_size)
    edges = edge_attribution(model, pairs, "eap")
    curve = circuit_faithfulness(model, pairs, edges, random_draws=3, seed=1)
    inner = curve[(curve["n_edges"] > 0) & (curve["n_edges"] < curve["n_edges"].max())]
    assert (inner["n_edges_pruned"] > 0).any()
    # the closest a few redraws reach: one edge more where one edge joins two into a path
    top = inner["n_edges_pruned"]
    assert ((inner["n_random_pruned_min"] - top).abs() <= 1).all(), inner
    assert ((inner["n_random_pruned_max"] - top).abs() <= 1).all(), inner
    assert (inner.loc[top > 0, "n_random_pruned_min"] > 0).all()  # drawn at the unpruned size, pruned to 0
    g = circuit_graph(model)
    rng = np.random.default_rng(0)
    for size in (0, 7, 60, 200):
        kept = random_circuit(g, size, rng)
        assert int(kept.sum()) == size
        edges = {(g.senders[a], g.receivers[b]) for a, b in zip(*np.nonzero(kept))}
        assert ref.eap_ig_prune(edges) == edges  # a pruned circuit, by EAP-IG's rule


def _edge_set(g, kept) -> set[tuple[str, str]]:
    return {(g.senders[a], g.receivers[b]) for a, b in zip(*np.nonzero(kept))}


def test_prune_circuit_is_eap_igs_rule_on_a_hand_built_graph():
    """Two layers of two heads. Kept: the path embed -> 0.heads.0 -> 1.heads.1 -> logits, and
    edges that must go: out of 0.heads.1, which reads nothing; out of 1.mlp_out, fed only by
    0.heads.1 (so it goes in the second round); into 1.heads.0, which writes nowhere; out of
    0.mlp_out, which reads nothing. The answer is the path alone. Feeding 0.mlp_out (embed ->
    0.mlp_in) keeps it and its edge into the live 1.heads.1. EAP-IG's rule (reimplemented from its
    ``Graph.prune``) agrees on both and on random circuits of sequential, parallel and grouped-query
    graphs."""
    from depthscope.analyses.circuits.edges.graph import CircuitGraph, edge_matrix, prune_circuit

    g = CircuitGraph(2, 2)
    path = [("embed", "0.q.0"), ("0.heads.0", "1.v.1"), ("1.heads.1", "logits")]
    rest = [("0.heads.1", "1.mlp_in"), ("1.mlp_out", "logits"), ("embed", "1.k.0"), ("0.mlp_out", "1.q.1")]
    assert _edge_set(g, prune_circuit(g, edge_matrix(g, path + rest))) == set(path)
    assert ref.eap_ig_prune(set(path + rest)) == set(path)
    fed = path + rest + [("embed", "0.mlp_in")]
    want = set(path) | {("embed", "0.mlp_in"), ("0.mlp_out", "1.q.1")}
    assert _edge_set(g, prune_circuit(g, edge_matrix(g, fed))) == want == ref.eap_ig_prune(set(fed))
    assert prune_circuit(g, np.zeros_like(g.mask)).sum() == 0
    rng = np.random.default_rng(3)
    for graph in (CircuitGraph(3, 4), CircuitGraph(3, 4, parallel=True), CircuitGraph(4, 4, n_kv_heads=2)):
        for density in (0.01, 0.03, 0.1, 0.4):
            kept = graph.mask & (rng.random(graph.mask.shape) < density)
            assert _edge_set(graph, prune_circuit(graph, kept)) == ref.eap_ig_prune(_edge_set(graph, kept))


@pytest.mark.parametrize("parallel", [False, True])
def test_mib_json_reads_back_as_mibs_graph(parallel):
    """circuit_mib.json read as MIB's Graph.from_json reads it (a reader written from its code):
    every edge of Graph.from_model's graph is there by name, the circuit's edges are in_graph, its
    nodes too, and the scores are the ones given."""
    from depthscope.analyses.circuits.edges.graph import CircuitGraph, mib_graph, prune_circuit

    g = CircuitGraph(3, 4, parallel=parallel)
    rng = np.random.default_rng(4)
    scores = np.where(g.mask, rng.normal(size=g.mask.shape), 0.0)
    kept = prune_circuit(g, g.mask & (rng.random(g.mask.shape) < 0.4))
    assert kept.sum() > 5
    d = json.loads(json.dumps(mib_graph(g, scores, kept, d_model=32)))
    in_graph, nodes, read_scores = ref.read_mib_graph(d)
    assert len(d["edges"]) == g.n_edges == len(read_scores)
    assert in_graph == {ref.mib_edge_name(s, r) for s, r in _edge_set(g, kept)}
    assert nodes == {ref.mib_edge_name(s, "logits").split("->")[0] for s, _ in _edge_set(g, kept)}
    s_idx, r_idx = g.edge_index
    for a, b in zip(s_idx[::37], r_idx[::37]):
        assert read_scores[ref.mib_edge_name(g.senders[a], g.receivers[b])] == pytest.approx(scores[a, b])


def test_cpr_ranks_by_mibs_signed_score_and_cmd_by_magnitude(tiny):
    """MIB: CPR from the top edges by signed score (an edge supporting the target positive, the
    negation of depthscope's score), CMD from the top edges by |score|; both curves in the table."""
    from depthscope.analyses.circuits.edges.faithfulness import MIB_SIGN, edge_scores_of, top_circuit

    model, hf = tiny("gpt2")
    pairs, _ = _pairs(hf.config.vocab_size)
    edges = edge_attribution(model, pairs, "eap")
    g = circuit_graph(model)
    scores = edge_scores_of(g, edges)
    assert MIB_SIGN == -1
    n = 30
    signed = top_circuit(g, scores, n, pruned=False, signed=True)
    s, r = g.edge_index
    assert scores[signed[s, r]].max() <= np.sort(scores)[n - 1]  # the n most negative depthscope scores
    curve = circuit_faithfulness(model, pairs, edges, random_draws=0)
    assert not np.allclose(curve["f"], curve["f_signed"])
    assert curve.attrs["cpr"] == pytest.approx(areas(curve["fraction"], curve["f_signed"])[0])
    assert curve.attrs["cmd"] == pytest.approx(areas(curve["fraction"], curve["f"])[1])
    assert curve.attrs["cpr_abs"] == pytest.approx(areas(curve["fraction"], curve["f"])[0])
    small = curve[(curve["fraction"] > 0) & (curve["fraction"] <= 0.05)]
    want = np.trapezoid(small["f_signed"], small["fraction"]) / (0.05 - 0.001)
    assert curve.attrs["cpr_5pct"] == pytest.approx(want)


def test_faithfulness_intervals_over_pairs(tiny):
    model, hf = tiny("llama")
    pairs, _ = _pairs(hf.config.vocab_size, n=12)
    edges = edge_attribution(model, pairs[:4], "eap")
    curve = circuit_faithfulness(model, pairs, edges, random_draws=0)
    inner = curve[(curve["n_edges_pruned"] > 0) & (curve["fraction"] < 1)]
    assert (inner["f_low"] < inner["f_high"]).all()
    assert (inner["f_low"] <= inner["f"] + 1e-9).all() and (inner["f"] <= inner["f_high"] + 1e-9).all()
    a = curve.attrs
    assert a["cpr_low"] <= a["cpr"] <= a["cpr_high"] and a["cmd_low"] <= a["cmd"] <= a["cmd_high"]
    assert (curve["ci_n"] == 12).all() and "bootstrap" in curve["ci_method"].iloc[0] and a["notes"] == []
    few = circuit_faithfulness(model, pairs[:9], edges, random_draws=0)
    assert few["f_low"].isna().all() and np.isnan(few.attrs["cpr_low"])
    assert len(few.attrs["notes"]) == 1 and "9 pairs" in few.attrs["notes"][0]


def _write_pairs(path, n):
    """``n`` pairs of two templates whose names swap (the tiny tokenizer keeps their lengths equal)."""
    a, b = ("cat", "dog"), ("dog", "cat")
    templates = ["the {} sat on the mat", "the {} ran to the park"]
    rows = [
        {
            "clean": templates[i % 2].format((a, b)[i // 2 % 2][0]),
            "corrupted": templates[i % 2].format((a, b)[i // 2 % 2][1]),
            "target": " mat",
            "foil": " cat",
        }
        for i in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))


@pytest.mark.parametrize("in_sample", [False, True])
def test_circuit_command_summary_matches_the_api(tiny_llama_dir, tmp_path, monkeypatch, capsys, in_sample):
    """The summary's numbers are the API's on the held-out pairs (or, --in-sample, on all of them),
    it names the split, and circuit_mib.json carries MIB's sign."""
    import pandas as pd

    from depthscope.analyses.circuits.pairs import read_pairs, split_pairs
    from depthscope.hooks import load_model
    from tests.conftest import run_cli

    pairs = tmp_path / "pairs.jsonl"
    _write_pairs(pairs, 6)
    out = tmp_path / "out"
    args = ["circuit", "--pairs", pairs, "--model", tiny_llama_dir, "--out", out, "--random-draws", "1"]
    args += ["--bootstrap", "0", "--no-plots", "--seed", "2"] + (["--in-sample"] if in_sample else [])
    code, stdout, stderr = run_cli(args, monkeypatch, capsys)
    assert code == 0, stderr
    summary = json.loads((out / "circuit_summary.json").read_text())
    all_pairs = read_pairs(pairs)
    train, held = (all_pairs, all_pairs) if in_sample else split_pairs(all_pairs, 0.5, seed=2)
    assert (summary["split"]["n_train"], summary["split"]["n_eval"]) == (len(train), len(held))
    assert summary["split"]["in_sample"] is in_sample and ("in-sample" in summary["split"]["mode"]) is in_sample
    model = load_model(tiny_llama_dir)
    edges = edge_attribution(model, train, "eap")
    curve = circuit_faithfulness(model, held, edges, random_draws=1, seed=2)
    for k in ("cpr", "cmd", "cpr_abs", "cpr_random", "cpr_5pct"):
        assert summary[k] == pytest.approx(curve.attrs[k], abs=1e-6), k
    assert summary["n_eval_pairs"] == len(held) and summary["cpr_low"] is None and summary["notes"]  # NaN: null
    written = pd.read_parquet(out / "faithfulness.parquet")
    np.testing.assert_allclose(written["f"], curve["f"], atol=1e-6)
    mib = json.loads((out / "circuit_mib.json").read_text())
    top = edges.loc[edges["score"].abs().idxmax()]
    from depthscope.analyses.circuits.edges.graph import mib_name

    assert mib["edges"][mib_name(top["sender"], top["receiver"])]["score"] == pytest.approx(-top["score"], rel=1e-5)
    # MIB's reader gets the drawn circuit of edges.parquet back
    in_graph, _, _ = ref.read_mib_graph(mib)
    drawn = pd.read_parquet(out / "edges.parquet").query("in_circuit")
    assert len(drawn) > 0 and in_graph == {ref.mib_edge_name(s, r) for s, r in zip(drawn["sender"], drawn["receiver"])}


def test_circuit_command_mean_ablation_scores_and_judges_with_one_mean(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """--ablation mean: the scores and the curve use the mean of --mean-pairs (the API's numbers
    with that SenderMeans); --mean-pairs without mean ablation is refused."""
    from depthscope.analyses.circuits.edges.ablation import sender_means
    from depthscope.analyses.circuits.pairs import read_pairs, split_pairs
    from depthscope.hooks import load_model
    from tests.conftest import run_cli

    pairs, means_file = tmp_path / "pairs.jsonl", tmp_path / "means.jsonl"
    _write_pairs(pairs, 6)
    _write_pairs(means_file, 3)
    out = tmp_path / "out"
    args = ["circuit", "--pairs", pairs, "--model", tiny_llama_dir, "--out", out, "--random-draws", "0"]
    args += ["--bootstrap", "0", "--no-plots", "--ablation", "mean", "--mean-pairs", means_file]
    code, stdout, stderr = run_cli(args, monkeypatch, capsys)
    assert code == 0, stderr
    summary = json.loads((out / "circuit_summary.json").read_text())
    assert str(means_file) in summary["split"]["mean_source"]
    model = load_model(tiny_llama_dir)
    train, held = split_pairs(read_pairs(pairs), 0.5, seed=0)
    means = sender_means(model, read_pairs(means_file))
    edges = edge_attribution(model, train, "eap", ablation=means)
    curve = circuit_faithfulness(model, held, edges, means, random_draws=0)
    for k in ("cpr", "cmd", "cpr_abs"):
        assert summary[k] == pytest.approx(curve.attrs[k], abs=1e-6), k
    own = edge_attribution(model, train, "eap", ablation="mean")  # the scoring pairs' own mean: other scores
    assert not np.allclose(own["score"], edges["score"])
    code, _, stderr = run_cli(args[:-4] + ["--mean-pairs", means_file], monkeypatch, capsys)
    assert code != 0 and "--mean-pairs" in stderr and "Traceback" not in stderr
