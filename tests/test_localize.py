"""Interchange interventions and DAS (analyses/causal: counterfactuals, templates, iia, alignment,
subspaces; ``depthscope localize`` and ``depthscope data agreement``), against independent references:

* full-vector interchange equals depthscope's activation patching of that site and position, and a
  plain-transformers reference (forward hooks of the test's own on the decoder layers);
* on a tiny synthetic model that writes a variable into a known direction, DAS with one direction
  recovers it (|cos| >= 0.99) with IIA 1.0 while a random direction stays at chance;
* the learned subspace is a function of the train examples only; DAS trains nothing of the model;
* datasets: every line checked before a model loads, errors naming the file and line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import run_cli

from depthscope.analyses import (
    Counterfactual,
    activation_patching,
    agreement_examples,
    das,
    interchange,
    ioi_examples,
    load_subspaces,
    overlap,
    random_basis,
    read_counterfactuals,
    save_subspaces,
    score_subspace,
    solved,
    split_examples,
    write_counterfactuals,
)
from depthscope.analyses.causal.variables.alignment import N_RANDOM, random_control
from depthscope.analyses.causal.variables.config import LocalizeConfig
from depthscope.analyses.circuits.pairs import PromptPair
from depthscope.analyses.jobs.localize import localize_job, summary_table
from depthscope.common.errors import InputError
from depthscope.hooks import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

GOOD = {"base": "The cat", "source": "The dog", "candidates": [" Mary", " John"], "label": " John"}


# ----------------------------------------------------------------------------- datasets
@pytest.mark.parametrize(
    "line, why",
    [
        ("{not json", "not a JSON object"),
        (json.dumps({**GOOD, "label": " Paris"}), "'label' must be one of the candidates"),
        (json.dumps({**GOOD, "source_label": " Paris"}), "'source_label' must be one of the candidates"),
        (json.dumps({**GOOD, "candidates": [" Mary"]}), "'candidates' must be a list of 2"),
        (json.dumps({**GOOD, "candidates": [" Mary", " Mary"]}), "distinct"),
        (json.dumps({**GOOD, "positions": {"S": [1, 2, 3]}}), "position 'S'"),
        (json.dumps({**GOOD, "base": ""}), "'base' must be a non-empty string"),
        (json.dumps({**GOOD, "colour": "red"}), "unknown field"),
    ],
)
def test_every_line_is_checked_and_errors_name_file_and_line(tmp_path, line, why):
    p = tmp_path / "ex.jsonl"
    p.write_text(json.dumps(GOOD) + "\n\n" + line + "\n")
    with pytest.raises(InputError, match=why) as e:
        read_counterfactuals(p)
    assert f"{p}:3:" in str(e.value)
    with pytest.raises(InputError, match=why):  # the settings read the file on construction
        LocalizeConfig(examples=p)


def test_roundtrip_and_positions_checked_against_the_tokens(tmp_path, tiny_llama):
    ex = [
        Counterfactual.from_dict({**GOOD, "positions": {"S": [1, -1]}, "base_label": " Mary", "source_label": " John"})
    ]
    p = write_counterfactuals(ex, tmp_path / "e.jsonl")
    assert read_counterfactuals(p) == ex and ex[0].source_label == " John"
    assert '"base_label": " Mary", "source_label": " John"' in p.read_text()
    bad = [Counterfactual.from_dict({**GOOD, "positions": {"S": 7}}, "e.jsonl:1")]
    with pytest.raises(InputError, match=r"e.jsonl:1, position 'S': index 7 is outside the base"):
        interchange(tiny_llama, bad, sites="embed", positions="S")
    with pytest.raises(InputError, match="no position named 'X'"):
        interchange(tiny_llama, ex, sites="embed", positions="X")


def test_generated_positions_point_at_the_subject_and_the_repeated_name(tiny_tokenizer, tiny_llama):
    tok = tiny_tokenizer
    for e in agreement_examples(tiny_llama, 12, seed=3):
        for text, i in ((e.base, e.positions["SUBJ"][0]), (e.source, e.positions["SUBJ"][1])):
            subject = text.split()[1]
            assert subject.endswith(tok.decode(tok(text)["input_ids"][i]).strip())
        assert e.label != e.base_label and set(e.candidates) == {e.label, e.base_label}
        assert e.source_label == e.label  # the source's own number is the one the base takes
    for e in ioi_examples(tiny_llama, 8, seed=3):
        i = e.positions["S2"][0]
        assert tok.decode(tok(e.base)["input_ids"][i]) in e.candidates  # the repeated name, a candidate
        assert e.label != e.base_label and e.source_label is None  # the source's own names are no candidates


# ----------------------------------------------------------------------------- references
def _where(site: int) -> tuple[int, str]:
    """(decoder layer, kind) of a residual site of a Llama: the input of block 0 (``pre``), the
    stream after block ``l``'s attention (``attn``), block ``l``'s output (``mlp``)."""
    if site == 0:
        return 0, "pre"
    return (site - 1) // 2, "attn" if site % 2 else "mlp"


def _read_or_write(hf, ids, layer: int, kind: str, pos: int, write=None):
    """(the stream at the site and position, last-position logits) of one forward of ``ids`` with
    forward hooks of this test's own on the transformers layers; ``write``: the vector put there."""
    block, got = hf.model.layers[layer], {}

    def put(h):
        got["v"] = h[0, pos].clone()
        if write is None:
            return h
        h = h.clone()
        h[0, pos] = write
        return h

    def pre(mod, args, kwargs):
        got["pre"] = args[0]
        if kind == "pre":
            return (put(args[0]), *args[1:]), kwargs
        return None

    def attn(mod, args, out):
        if kind == "attn":  # the block adds the attention's output to its input: write the difference
            mid = put(got["pre"] + out[0])
            return (mid - got["pre"], *out[1:])
        return None

    def post(mod, args, out):
        if kind == "mlp":
            return (put(out[0]), *out[1:]) if isinstance(out, tuple) else put(out)
        return None

    handles = [
        block.register_forward_pre_hook(pre, with_kwargs=True),
        block.self_attn.register_forward_hook(attn),
        block.register_forward_hook(post),
    ]
    try:
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    return got["v"], logits


def _plain_reference(hf, examples, tok, site: int, position: str):
    """(hits, logit diffs, output-token hits) of full-vector interchange at one residual site, with
    plain transformers forward hooks (:func:`_read_or_write`)."""
    layer, kind = _where(site)
    hits, diffs, tokens = [], [], []
    for e in examples:
        b_ids, s_ids = (torch.tensor([tok(x)["input_ids"]]) for x in (e.base, e.source))
        pos = (e.positions or {}).get(position, -1)
        pb, ps = (pos, pos) if isinstance(pos, int) else pos
        source, _ = _read_or_write(hf, s_ids, layer, kind, ps % s_ids.shape[1])
        _, logits = _read_or_write(hf, b_ids, layer, kind, pb % b_ids.shape[1], write=source)
        ids = [tok(x, add_special_tokens=False)["input_ids"][0] for x in e.candidates]
        c = logits[ids]
        lab = e.candidates.index(e.label)
        hits.append(int(c.argmax()) == lab)
        diffs.append(float(c[lab] - (c.sum() - c[lab]) / (len(c) - 1)))
        tokens.append(int(logits.argmax()) == ids[lab])  # the output token over the whole vocabulary
    return np.array(hits), np.array(diffs), np.array(tokens)


def test_full_vector_interchange_equals_a_plain_transformers_reference(tiny_factory, tiny_tokenizer):
    model = tiny_factory("llama", n_layers=2)
    exs = agreement_examples(model, 10, seed=11)
    exs = [Counterfactual(e.base, e.source, (" Mary", " John"), " John", " Mary", "x", e.positions) for e in exs]
    t = interchange(model, exs, sites="resid", positions="SUBJ,END")
    assert len(t) == 2 * 5 and list(t.columns[:5]) == ["site", "label", "layer", "sublayer", "depth"]
    for _, row in t.iterrows():
        hits, diffs, tokens = _plain_reference(model.hf_model, exs, tiny_tokenizer, int(row["site"]), row["position"])
        assert row["iia"] == hits.mean() and row["iia_token"] == tokens.mean() <= row["iia"]
        assert row["logit_diff"] == pytest.approx(diffs.mean(), abs=1e-4)
    assert t["ci_n"].eq(10).all() and t["iia_low"].notna().all() and t.attrs["notes"] == []
    assert (t["iia_low"] <= t["iia"]).all() and (t["iia"] <= t["iia_high"]).all()


def test_output_token_iia_counts_the_models_top_token(tiny_factory, tiny_tokenizer):
    """``iia_token``: the model's output token over the whole vocabulary is the label's. Swapping
    the last site at the last position makes the base's output the source's; with the label the
    source's top token (every other example) or its second (the others), iia_token there is the
    share of the first kind, and the candidates-only IIA counts both whenever the label beats the
    other candidate. Against plain transformers at every site."""
    model = tiny_factory("llama", n_layers=2)
    hf, tok = model.hf_model, tiny_tokenizer
    exs, kinds = [], []
    for i, e in enumerate(agreement_examples(model, 32, seed=11)):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([tok(e.source)["input_ids"]])).logits[0, -1]
        top = int(logits.topk(2).indices[i % 2])
        word = tok.decode([top])
        if tok(word, add_special_tokens=False)["input_ids"][:1] == [top] and word != " Mary":
            exs.append(Counterfactual(e.base, e.source, (word, " Mary"), word, " Mary", "x", e.positions))
            kinds.append(i % 2 == 0)
    assert sum(kinds) >= 3 and len(kinds) - sum(kinds) >= 3
    t = interchange(model, exs, sites="resid", positions="END")
    last = t[t["label"] == "1.mlp"].iloc[0]
    assert last["iia_token"] == pytest.approx(np.mean(kinds)) and last["iia_token"] < last["iia"]
    for _, row in t.iterrows():
        hits, _, tokens = _plain_reference(hf, exs, tok, int(row["site"]), "END")
        assert row["iia"] == hits.mean() and row["iia_token"] == tokens.mean() <= row["iia"]


def test_full_vector_interchange_equals_activation_patching(tiny_llama):
    exs = ioi_examples(tiny_llama, 6, seed=5)
    sites = "embed,0.attn,1.mlp,2.mlp"
    t = interchange(tiny_llama, exs, sites=sites, positions="S2,END")
    for position, mode in (("S2", "S2"), ("END", "last")):
        pairs = [
            PromptPair(
                e.source,
                e.base,
                e.label,
                next(c for c in e.candidates if c != e.label),
                {"S2": e.positions["S2"][::-1]},  # patching names [clean, corrupted] = [source, base]
            )
            for e in exs
        ]
        ref = activation_patching(tiny_llama, pairs, sites=sites, positions=mode)
        got = t[t["position"] == position]
        np.testing.assert_allclose(got["logit_diff"].to_numpy(), ref["metric"].to_numpy(), atol=1e-4)


def test_an_interval_on_too_few_examples_is_withheld_with_a_note(tiny_llama):
    t = interchange(tiny_llama, ioi_examples(tiny_llama, 4, seed=1), sites="embed")
    assert t["iia_low"].isna().all() and "4 examples" in t.attrs["notes"][0]
    assert t["ci_method"].iloc[0].startswith("Wilson")


# ----------------------------------------------------------------------------- the examples the model solves
def _plain_solved(hf, examples, tok) -> np.ndarray:
    """Per example: a plain transformers forward's argmax over the candidates at the last position is
    ``base_label`` for the base and, where set, ``source_label`` for the source."""
    out = []
    for e in examples:
        ok = True
        for text, want in ((e.base, e.base_label), (e.source, e.source_label)):
            if want is None:
                continue
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([tok(text)["input_ids"]])).logits[0, -1]
            c = logits[[tok(x, add_special_tokens=False)["input_ids"][0] for x in e.candidates]]
            assert abs(float(c[0] - c[1])) > 1e-4, "a near tie: the reference cannot decide"
            ok = ok and int(c.argmax()) == e.candidates.index(want)
        out.append(ok)
    return np.array(out)


def _mixed_labels(model, n: int, seed: int) -> list[Counterfactual]:
    """Agreement prompts with the tiny model's names as candidates and labels that it gets right on
    some examples and wrong on others (``source_label`` unset on every third)."""
    names = (" Mary", " John")
    out = []
    for i, e in enumerate(agreement_examples(model, n, seed=seed)):
        src = None if i % 3 == 0 else names[(i // 2) % 2]
        out.append(Counterfactual(e.base, e.source, names, " John", names[i % 2], "x", e.positions, source_label=src))
    return out


def test_solved_equals_a_plain_transformers_forward(tiny_llama, tiny_tokenizer):
    exs = _mixed_labels(tiny_llama, 24, seed=4)
    want = _plain_solved(tiny_llama.hf_model, exs, tiny_tokenizer)
    assert want.any() and not want.all()  # the labels split the examples: the comparison can fail
    got = solved(tiny_llama, exs, batch_size=5)  # batches smaller than the groups of equal length
    assert got.dtype == bool and np.array_equal(got, want)
    base_only = solved(tiny_llama, [replace(e, source_label=None) for e in exs])
    assert np.array_equal(
        base_only, _plain_solved(tiny_llama.hf_model, [replace(e, source_label=None) for e in exs], tiny_tokenizer)
    )
    assert (base_only >= got).all()  # the source's check only removes examples
    with pytest.raises(InputError, match=r"ex.jsonl:2: no 'base_label'; --only-solved needs base_label"):
        solved(tiny_llama, [exs[0], replace(exs[1], base_label=None, where="ex.jsonl:2")])


def test_localize_only_solved_filters_train_and_test(tiny_llama, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    exs = _mixed_labels(tiny_llama, 24, seed=4)
    path = write_counterfactuals(exs, tmp_path / "ex.jsonl")
    cfg = LocalizeConfig(examples=path, sites="embed,1.mlp", only_solved=True, plots=False)
    res = localize_job(tiny_llama, cfg, progress=False)
    train, test = split_examples(read_counterfactuals(path), cfg.train_fraction, cfg.seed)
    s = res.summary
    assert (s["n_train_all"], s["n_test_all"]) == (len(train), len(test))
    assert (s["n_train"], s["n_test"]) == (int(solved(tiny_llama, train).sum()), int(solved(tiny_llama, test).sum()))
    assert 0 < s["n_test"] < s["n_test_all"] and (res.tables["localize"]["n_test"] == s["n_test"]).all()
    caption = summary_table(res.tables["localize"], s).caption
    assert f"dropped {len(exs) - s['n_train'] - s['n_test']} of {len(exs)} examples" in caption
    args = ["localize", "--examples", path, "--model", tiny_llama_dir, "--sites", "embed", "--no-plots"]
    code, stdout, err = run_cli([*args, "--only-solved", "--out", tmp_path / "cli"], monkeypatch, capsys)
    assert code == 0 and "--only-solved: dropped" in stdout, err
    cli = json.loads((tmp_path / "cli" / "localize_summary.json").read_text())
    assert [cli[k] for k in ("n_train", "n_test", "n_train_all", "n_test_all")] == [
        s[k] for k in ("n_train", "n_test", "n_train_all", "n_test_all")
    ]
    every = localize_job(tiny_llama, replace(cfg, only_solved=False), progress=False).summary
    assert every["n_test"] == every["n_test_all"] == len(test)
    none = write_counterfactuals([e for e, ok in zip(exs, solved(tiny_llama, exs)) if not ok], tmp_path / "none.jsonl")
    with pytest.raises(InputError, match=r"--only-solved: the model solves 0 of \d+ train and 0 of \d+ test"):
        localize_job(tiny_llama, replace(cfg, examples=none), progress=False)


def test_localize_warns_of_test_examples_that_are_train_examples(
    tiny_llama, tiny_llama_dir, tmp_path, monkeypatch, capsys, caplog
):
    exs = agreement_examples(tiny_llama, 24, seed=2)
    train, rest = write_counterfactuals(exs[:16], tmp_path / "train.jsonl"), exs[16:]
    # three train examples again (one with another label and no base_label: the same prompts), five new
    leaked = [exs[0], exs[5], replace(exs[9], base_label=None)]
    test = write_counterfactuals([*leaked, *rest[:5]], tmp_path / "test.jsonl")
    assert overlap(read_counterfactuals(train), read_counterfactuals(test)) == 3
    assert overlap(exs[:16], rest) == 0 and overlap(exs[:2], [exs[1], exs[1]]) == 2  # each test example counts
    args = ["localize", "--examples", train, "--model", tiny_llama_dir, "--sites", "embed", "--no-plots"]
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        code, _, err = run_cli([*args, "--test", test, "--out", tmp_path / "leak"], monkeypatch, capsys)
    assert code == 0, err
    assert f"3 of 8 test examples (--test {test}) are also train examples" in caplog.text
    assert json.loads((tmp_path / "leak" / "localize_summary.json").read_text())["test_overlap"] == 3
    caplog.clear()
    clean = write_counterfactuals(rest, tmp_path / "clean.jsonl")
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        code, _, err = run_cli([*args, "--test", clean, "--out", tmp_path / "clean"], monkeypatch, capsys)
    assert code == 0 and "also train examples" not in caplog.text, err
    assert json.loads((tmp_path / "clean" / "localize_summary.json").read_text())["test_overlap"] == 0


def test_the_best_site_is_chosen_on_a_train_slice_and_measured_on_the_test_examples(tiny_llama, tmp_path):
    """By default each position's best site is the one of highest IIA on a seeded fifth of the
    train examples, and its IIA, interval and iia_token are the test examples' (the API's numbers
    on those parts); select_fraction 0 chooses on the test examples and says so."""
    exs = agreement_examples(tiny_llama, 40, seed=2)
    path = write_counterfactuals(exs, tmp_path / "ex.jsonl")
    sites, positions = "embed,0.mlp,1.attn,1.mlp", "SUBJ,END"
    cfg = LocalizeConfig(examples=path, sites=sites, positions=positions, plots=False)
    res = localize_job(tiny_llama, cfg, progress=False)
    t, s = res.tables["localize"], res.summary
    train, test = split_examples(read_counterfactuals(path), 0.5, 0)
    _, select = split_examples(train, 0.8, 1)
    chooser = interchange(tiny_llama, select, sites=sites, positions=positions)
    assert s["n_select"] == len(select) == 4 and s["best_site_chosen_on"].startswith("train slice")
    for pos, best in s["best_sites"].items():
        c = chooser[chooser["position"] == pos].sort_values("depth")
        site = c.loc[c["iia"].idxmax(), "label"]  # the first of the highest, in depth order
        row = t[(t["position"] == pos) & (t["label"] == site)].iloc[0]
        assert best["site"] == site and best["iia_chosen_on"] == c["iia"].max()
        assert (best["iia"], best["iia_low"], best["iia_token"]) == (row["iia"], row["iia_low"], row["iia_token"])
    assert "train slice" in summary_table(t, s).caption
    on_test = localize_job(tiny_llama, replace(cfg, select_fraction=0.0), progress=False)
    t0, s0 = on_test.tables["localize"], on_test.summary
    assert s0["best_site_chosen_on"] == "test" and s0["n_select"] == 0 and set(s0["best_sites"]) == {"SUBJ", "END"}
    for pos, best in s0["best_sites"].items():
        d = t0[t0["position"] == pos].sort_values("depth")
        assert best["iia"] == d["iia"].max() and best["site"] == d.loc[d["iia"] == d["iia"].max(), "label"].iloc[0]
    assert "best site chosen on the test examples" in summary_table(t0, s0).caption


def test_das_in_localize_trains_without_the_selection_slice(tiny_llama, tmp_path):
    path = write_counterfactuals(agreement_examples(tiny_llama, 20, seed=4), tmp_path / "ex.jsonl")
    cfg = LocalizeConfig(examples=path, method="das", sites="0.mlp", epochs=1, plots=False)
    res = localize_job(tiny_llama, cfg, progress=False)
    s, t = res.summary, res.tables["localize"]
    assert s["n_select"] == 2 and s["n_train"] - s["n_select"] == 8 and (t["n_train"] == 8).all()
    assert "DAS trains on the other train examples" in s["best_site_chosen_on"]


# ----------------------------------------------------------------------------- DAS
A, B = [" cat", " dog", " bird", " house", " mat"], [" log", " capital", " France", " Italy", " Paris"]
FILLER = [" the", " sat", " on", " world", " words"]


@pytest.fixture(scope="module")
def synthetic(tiny_tokenizer):
    """A one-block Llama whose blocks write nothing, whose embedding puts +3u (words of A) or -3u
    (words of B) along a unit direction ``u`` (nothing along ``u`` for other tokens), and whose
    unembedding reads ``u`` alone: ``" Mary"`` for A, ``" John"`` for B. The variable (which set
    the last word is in) lives in ``u`` at every site of the last position."""
    import transformers as tf

    tok = tiny_tokenizer

    def tid(w):
        return tok(w, add_special_tokens=False)["input_ids"][0]

    torch.manual_seed(0)
    d = 32
    cfg = tf.LlamaConfig(
        hidden_size=d,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    hf = tf.LlamaForCausalLM(cfg).eval()
    u = torch.randn(d)
    u /= u.norm()
    with torch.no_grad():
        emb = hf.model.embed_tokens.weight
        emb -= (emb @ u)[:, None] * u
        for w in A:
            emb[tid(w)] += 3 * u
        for w in B:
            emb[tid(w)] -= 3 * u
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.lm_head.weight.zero_()
        hf.lm_head.weight[tid(" Mary")] = 0.5 * u
        hf.lm_head.weight[tid(" John")] = -0.5 * u
    rng = np.random.default_rng(0)

    def example():
        x, y = rng.choice(A + B), rng.choice(A + B)
        value = {w: " Mary" if w in A else " John" for w in A + B}
        base = "The" + rng.choice(FILLER) + x
        source = "The" + rng.choice(FILLER) + rng.choice(FILLER) + y
        return Counterfactual(base, source, (" Mary", " John"), value[y], value[x], "set")

    train = [example() for _ in range(160)]
    test = [example() for _ in range(100)]
    return load_model(hf, tokenizer=tok), u, train, test


def test_das_recovers_the_known_direction_and_random_stays_at_chance(synthetic):
    model, u, train, test = synthetic
    before = {k: v.clone() for k, v in model.hf_model.state_dict().items()}
    trainable = [p.requires_grad for p in model.hf_model.parameters()]
    res = das(model, train, test, sites="embed,0.mlp", positions="END", dim=1, config=LocalizeConfig(epochs=10))
    for (label, _), sub in res.subspaces.items():
        assert abs(float(sub.basis[:, 0] @ u)) >= 0.99, label
    t = res.table
    assert (t["iia"] == 1.0).all() and (t["dim"] == 1).all() and (t["n_train"] == 160).all()
    # chance: a random direction moves (almost) nothing, so its IIA is the no-intervention floor
    # (how often the source's value equals the base's: about half)
    assert (abs(t["iia_random"] - t["iia_unchanged"]) <= 0.05).all()
    assert (abs(t["iia_unchanged"] - 0.5) <= 0.15).all()
    # only the basis was trained: the model's weights are bit-identical and hold no gradient
    after = model.hf_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.hf_model.parameters())
    assert [p.requires_grad for p in model.hf_model.parameters()] == trainable  # restored


def test_the_random_control_is_several_seeded_bases_and_their_mean(synthetic):
    seen = []

    def measure(basis):  # hits: the basis's positive coordinates (a different IIA per basis)
        seen.append(basis)
        return (basis[:, 0] > 0).numpy()

    got = random_control(measure, 32, 2, seed=7)
    iias = [float((b[:, 0] > 0).float().mean()) for b in seen]
    assert got["n_random"] == N_RANDOM == len(seen) >= 5
    assert all(not torch.equal(a, b) for i, a in enumerate(seen) for b in seen[i + 1 :])  # the draws differ
    assert all(torch.equal(b, random_basis(32, 2, 7 + i)) for i, b in enumerate(seen, 1))  # seeded
    assert got["iia_random"] == pytest.approx(np.mean(iias)) and len(set(iias)) > 1
    assert (got["iia_random_min"], got["iia_random_max"]) == (min(iias), max(iias))
    model, _, train, test = synthetic
    t = das(model, train, test[:40], sites="0.mlp", dim=1, config=LocalizeConfig(epochs=1)).table
    assert (t["n_random"] == N_RANDOM).all()
    assert (t["iia_random_min"] <= t["iia_random"]).all() and (t["iia_random"] <= t["iia_random_max"]).all()


def test_the_subspace_never_sees_the_test_examples(synthetic):
    model, _, train, test = synthetic
    cfg = LocalizeConfig(epochs=1)
    a = das(model, train, test[:50], sites="0.mlp", dim=1, config=cfg).subspaces["0.mlp", "END"]
    b = das(model, train, test[50:], sites="0.mlp", dim=1, config=cfg).subspaces["0.mlp", "END"]
    assert torch.equal(a.basis, b.basis)  # a function of the train examples (and the seed) alone
    c = das(model, train[:80], test[:50], sites="0.mlp", dim=1, config=cfg).subspaces["0.mlp", "END"]
    assert not torch.equal(a.basis, c.basis)


def test_measure_subspaces_gives_das_iia_on_the_same_examples(synthetic):
    """The IIA of learned subspaces measured again on the test examples is das's own."""
    from depthscope.analyses.causal.variables.alignment import measure_subspaces

    model, _, train, test = synthetic
    res = das(model, train, test[:40], sites="embed,0.mlp", dim=1, config=LocalizeConfig(epochs=1))
    again = measure_subspaces(model, test[:40], res.subspaces)
    cols = ["label", "position", "iia", "iia_low", "iia_token", "logit_diff", "iia_unchanged"]
    np.testing.assert_allclose(again[cols[2:]].to_numpy(float), res.table[cols[2:]].to_numpy(float), atol=1e-6)
    assert list(again["label"]) == list(res.table["label"]) and again["iia_random"].isna().all()
    other = measure_subspaces(model, test[40:80], res.subspaces)
    assert (other["n_test"] == 40).all() and not np.allclose(other["logit_diff"], again["logit_diff"])


def test_subspaces_save_load_steer_and_probe(synthetic, tmp_path):
    model, u, train, test = synthetic
    res = das(model, train, test, sites="0.mlp", dim=1, config=LocalizeConfig(epochs=10))
    sub = res.subspaces["0.mlp", "END"]
    [back] = load_subspaces(save_subspaces([sub], tmp_path / "s.safetensors"))
    assert torch.equal(back.basis, sub.basis) and back.label == "0.mlp" and set(back.values) == {" Mary", " John"}
    # steering: set the variable to " John" in a prompt whose last word says " Mary"
    prompt = "The cat"
    for value in (" John", " Mary"):
        gen = model.generate([prompt], max_new_tokens=1, hooks={"0.mlp": back.hook(value)})
        assert gen.text[0].strip() == value.strip()
        logits = model.run([prompt], hooks={"0.mlp": back.hook(value, positions="last")}).logits[0, -1]
        ids = [model.token_id(" Mary"), model.token_id(" John")]
        assert [" Mary", " John"][int(logits[ids].argmax())] == value
    score = score_subspace(model, back, train, test)
    assert score["accuracy"] == 1.0 and score["majority"] < 0.7


def test_boundless_das_learns_a_small_subspace(synthetic):
    model, u, train, test = synthetic
    res = das(model, train, test, sites="0.mlp", boundless=True, config=LocalizeConfig(epochs=6))
    row = res.table.iloc[0]
    assert row["method"] == "boundless das" and row["iia"] == 1.0 and 1 <= row["dim"] < 32


# ----------------------------------------------------------------------------- command line
def test_localize_command(tiny_llama_dir, tiny_llama, tmp_path, monkeypatch, capsys):
    ex = write_counterfactuals(agreement_examples(tiny_llama, 24, seed=2), tmp_path / "agreement.jsonl")
    out = tmp_path / "out"
    args = ["localize", "--examples", ex, "--model", tiny_llama_dir, "--out", out, "--sites", "embed,1.mlp"]
    code, stdout, err = run_cli(
        [*args, "--method", "das", "--positions", "SUBJ,END", "--epochs", "1"], monkeypatch, capsys
    )
    assert code == 0, err
    for f in ("localize.parquet", "localize.csv", "localize_iia.png", "localize_summary.json", "subspaces.safetensors"):
        assert (out / f).is_file(), f
    import pandas as pd

    t = pd.read_parquet(out / "localize.parquet")
    need = ["position", "method", "dim", "iia", "iia_low", "iia_high", "iia_random", "n_train", "n_test"]
    assert set(need) <= set(t.columns) and len(t) == 4 and "iia_token" in t.columns
    summary = json.loads((out / "localize_summary.json").read_text())
    # DAS trains on the train examples less the slice the best site is chosen on
    assert (t["n_train"] + summary["n_select"] + t["n_test"] == 24).all() and summary["n_select"] == 2
    three = ["--probe-task", "upos", "--probe-sentences", "12", "--out", tmp_path / "three"]
    code, stdout, err = run_cli([*args[:-4], "--sites", "embed,1.mlp", *three], monkeypatch, capsys)
    assert code == 0, err
    probes = pd.read_parquet(tmp_path / "three" / "localize_probes.parquet")
    assert {"accuracy", "used"} <= set(probes.columns) and len(probes) == 2
    assert (tmp_path / "three" / "localize_three_curves.png").is_file()
    assert pd.read_parquet(tmp_path / "three" / "localize.parquet")["method"].eq("interchange").all()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "label": "x"}) + "\n")
    code, _, err = run_cli(
        ["localize", "--examples", bad, "--model", tmp_path / "no-model", "--out", out], monkeypatch, capsys
    )
    assert code == 2 and f"{bad}:2:" in err  # the file is checked before any model loads (this one does not exist)


def test_data_generates_the_counterfactual_datasets(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    for name in ("agreement", "ioi"):
        code, stdout, err = run_cli(["data", name, "--model", tiny_llama_dir, "--copy", tmp_path], monkeypatch, capsys)
        assert code == 0, err
        path = stdout.strip().splitlines()[-1]
        assert path == str((tmp_path / f"{name}.jsonl").resolve()) and len(read_counterfactuals(path)) >= 100
    code, _, err = run_cli(["data", "ewt_train", "--model", tiny_llama_dir], monkeypatch, capsys)
    assert code == 2 and "generated set" in err


# ----------------------------------------------------------------------------- the default model
def test_agreement_iia_equals_plain_transformers_on_the_default_model(default_model, tokenizer):
    exs = agreement_examples(default_model, 16, seed=20_261_128)  # a seed no other test or doc uses
    sites = [0, 28, 51]  # the embedding, an attention and an MLP site: every kind of site once
    t = interchange(default_model, exs, sites=sites, positions="SUBJ,END")
    for _, row in t.iterrows():
        hits, diffs, tokens = _plain_reference(
            default_model.hf_model, exs, tokenizer, int(row["site"]), row["position"]
        )
        assert row["iia"] == hits.mean(), (row["label"], row["position"])
        assert row["iia_token"] == tokens.mean(), (row["label"], row["position"])
        assert row["logit_diff"] == pytest.approx(diffs.mean(), abs=2e-3)


def test_solved_equals_plain_transformers_on_the_default_model(default_model, tokenizer):
    exs = agreement_examples(default_model, 48, seed=20_261_129)  # a seed no other test or doc uses
    want = _plain_solved(default_model.hf_model, exs, tokenizer)
    assert want.any() and not want.all()  # the model gets some of them wrong: the comparison can fail
    assert np.array_equal(solved(default_model, exs), want)


def test_das_on_the_agreement_examples_the_model_solves_at_a_mid_depth_subject_site(default_model):
    """Issue 56's mark: one learned direction at 10.mlp (subject position) reaches IIA >= 0.9 on
    held-out examples the model solves, a random direction <= 0.3. Measured on 2026-11-28 with
    these examples (600 generated, seed 7; 487 solved: 324 train, 163 test; the default 4 epochs):
    8.mlp 0.939, 10.mlp 0.926, 12.mlp 0.859, the random direction 0.00-0.01 (docs/localize.md).
    On all 600 (the same split) IIA is capped by the model's own errors."""
    exs = agreement_examples(default_model, 600, seed=7)
    exs = [e for e, ok in zip(exs, solved(default_model, exs)) if ok]
    n = len(exs) * 2 // 3
    res = das(default_model, exs[:n], exs[n:], sites="10.mlp", positions="SUBJ", dim=1)
    row = res.table.iloc[0]
    assert row["iia"] >= 0.9 and row["iia_random"] <= 0.3, row.to_dict()
    assert row["iia_unchanged"] == 0.0  # solved: no test base already predicts the source's verb
