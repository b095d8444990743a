"""Causal erasure per depth (``depthscope.analyses.causal.erasure.used``) against independent references: the
eraser against concept_erasure's own ``LeaceEraser``, the erasing write hook against a plain PyTorch
forward hook on the transformers module, the loss against transformers' ``labels=`` loss, the
erased probe against the majority baseline, and the command's errors. Tiny models only (fast tier)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from concept_erasure import LeaceEraser
from conftest import run_cli, small_causal_config
from rich.console import Console

from depthscope.analyses.causal.erasure.config import CausalConfig
from depthscope.analyses.causal.erasure.erasers import (
    edit_rms,
    fit_erasure,
    fitting_covariance,
    one_hot,
    random_erasure,
)
from depthscope.analyses.causal.erasure.loss import DocLoss, doc_nll, held_out, used_interval, used_score
from depthscope.analyses.causal.erasure.used import causal_tests
from depthscope.analyses.jobs import Output
from depthscope.analyses.jobs.causal import report_causal, summary_table
from depthscope.analyses.jobs.configs import ProbeJobConfig, ReportConfig
from depthscope.analyses.report.data import build_page
from depthscope.common.errors import InputError
from depthscope.probes.config import DataConfig, ExtractionConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["The cat sat on the mat.", "Mary and John went to the store yesterday, and it rained."]


def _labelled(n=600, d=24, classes=4, seed=0):
    """Features whose class shifts the mean along a few directions, and their labels."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    means = 2.0 * torch.randn(classes, d, generator=g)
    x = torch.randn(n, d, generator=g) @ torch.randn(d, d, generator=g) * 0.5 + means[y] + 3.0
    return x.float(), y.numpy()


def test_eraser_equals_concept_erasures_leace_eraser():
    x, y = _labelled()
    er, _ = fit_erasure(x, y, 4)
    ref = LeaceEraser.fit(x.double(), one_hot(y, 4), constrain_cov_trace=False)
    assert er.rank == 3  # C - 1 directions for C classes
    torch.testing.assert_close(er(x), ref(x.double()).float(), atol=1e-5, rtol=1e-5)
    # the guarantee: no covariance with any class indicator is left
    xe = er(x).double()
    z = one_hot(y, 4)
    cov = (xe - xe.mean(0)).T @ (z - z.mean(0)) / len(x)
    assert cov.abs().max() < 1e-5
    cov_before = (x.double() - x.double().mean(0)).T @ (z - z.mean(0)) / len(x)
    assert cov_before.abs().max() > 0.1


def test_whitened_control_has_the_rank_and_form_but_leaves_the_concept():
    x, y = _labelled()
    er, fitter = fit_erasure(x, y, 4)
    ctrl = random_erasure(fitter, er.rank, seed=1, control="whitened")
    assert ctrl.rank == er.rank
    assert torch.equal(ctrl.bias, er.bias)
    eye = torch.eye(x.shape[1])
    P = eye - ctrl.left @ ctrl.right
    torch.testing.assert_close(P @ P, P, atol=1e-4, rtol=1e-4)  # a projection, like LEACE's
    torch.testing.assert_close(ctrl(x), (x - ctrl.bias) @ P.T + ctrl.bias, atol=1e-4, rtol=1e-4)
    xe = ctrl(x).double()
    z = one_hot(y, 4)
    assert ((xe - xe.mean(0)).T @ (z - z.mean(0)) / len(x)).abs().max() > 0.05
    other = random_erasure(fitter, er.rank, seed=2, control="whitened")
    assert not torch.allclose(other.left, ctrl.left)


def _rms(erasure, x):
    """The root mean square per row of the change ``x - erasure(x)``, the plain way (float64)."""
    return float((x.double() - erasure(x.double())).pow(2).sum(1).mean().sqrt())


def test_raw_control_edits_as_much_as_leace_in_raw_units_on_held_out_data():
    """Fitted on one half, the raw controls' edit equals LEACE's on it (exactly: the rms is matched
    there) and stays within 5% of it on the other half; each control is an orthogonal removal of
    ``rank`` random directions (a projection that keeps the mean), and leaves the concept."""
    x, y = _labelled(n=2000, d=32, classes=5, seed=3)
    fit, held = x[:1000], x[1000:]
    er, fitter = fit_erasure(fit, y[:1000], 5)
    target = edit_rms(er, fitter=fitter)
    assert target == pytest.approx(_rms(er, fit), rel=1e-6)  # from the fitter's sums = on the rows
    whitened = [_rms(random_erasure(fitter, er.rank, s, control="whitened"), fit) for s in range(8)]
    assert max(abs(w / target - 1) for w in whitened) > 0.2  # whitened controls: not LEACE's size
    for s in range(8):
        ctrl = random_erasure(fitter, er.rank, s, target_rms=target)
        assert ctrl.rank == er.rank and ctrl.info["scale"] == pytest.approx(1.0, abs=1e-3)
        assert _rms(ctrl, fit) == pytest.approx(target, rel=1e-5)
        assert edit_rms(ctrl, held) == pytest.approx(_rms(er, held), rel=0.05)
        q = ctrl.right.double().T
        torch.testing.assert_close(q.T @ q, torch.eye(er.rank, dtype=torch.float64), atol=1e-5, rtol=0)
        P = torch.eye(x.shape[1]) - ctrl.left @ ctrl.right
        torch.testing.assert_close(P @ P, P, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(P, P.T, atol=1e-3, rtol=1e-3)  # orthogonal, unlike LEACE's
        xe, z = ctrl(fit).double(), one_hot(y[:1000], 5)
        assert ((xe - xe.mean(0)).T @ (z - z.mean(0)) / len(xe)).abs().max() > 0.05
    a, b = (random_erasure(fitter, er.rank, s, target_rms=target) for s in (0, 1))
    assert not torch.allclose(a.right, b.right)
    with pytest.raises(InputError, match="control"):
        random_erasure(fitter, er.rank, 0, control="aimed")
    with pytest.raises(InputError, match="target_rms"):
        random_erasure(fitter, er.rank, 0)


def test_raw_control_out_of_reach_is_scaled_to_the_target():
    """A target beyond what removing ``rank`` directions can reach: the control is the removal
    nearest to it, scaled so that its edit still equals the target."""
    x, y = _labelled(n=800, d=16, classes=3)
    er, fitter = fit_erasure(x, y, 3)
    big = 10 * float(torch.linalg.eigvalsh(fitting_covariance(fitter)).sum().sqrt())
    ctrl = random_erasure(fitter, er.rank, 0, target_rms=big)
    assert ctrl.info["scale"] > 1.5 and edit_rms(ctrl, fitter=fitter) == pytest.approx(big, rel=1e-6)


def _layer_output_hook(fn, start):
    def hook(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        h = h.clone()
        h[:, start:] = fn(h[:, start:])
        return (h, *output[1:]) if isinstance(output, tuple) else h

    return hook


@pytest.mark.parametrize("site", ["embed", "1.mlp"])
def test_erasing_hook_equals_a_plain_torch_forward_hook(tiny_factory, site):
    m = tiny_factory("llama")
    d = m.hf_model.config.hidden_size
    x, y = _labelled(d=d)
    er, _ = fit_erasure(x, y, 4)
    ids = torch.tensor([[1, 5, 9, 42, 7, 3, 11, 8]])
    with torch.no_grad():
        clean = m.hf_model(input_ids=ids).logits
    got = m.run(ids, hooks={site: er.hook(1)}).logits
    module = m.hf_model.model.embed_tokens if site == "embed" else m.hf_model.model.layers[1]
    handle = module.register_forward_hook(_layer_output_hook(er, 1))
    try:
        with torch.no_grad():
            ref = m.hf_model(input_ids=ids).logits
    finally:
        handle.remove()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert (got - clean).abs().max() > 1e-4  # the edit does change the forward pass


def test_loss_equals_transformers_own_loss(tiny_factory):
    m = tiny_factory("llama")
    held = held_out(m, TEXTS, window=64, bos=True)
    assert held.start == 1 and held.n_docs == 2 and list(held.doc) == [0, 1]
    loss = doc_nll(m, held, batch_size=2)  # both documents in one right-padded batch
    nll, count = 0.0, 0
    with torch.no_grad():
        for d, row in enumerate(held.rows):
            ids = torch.as_tensor(row)[None]
            ref = float(m.hf_model(input_ids=ids, labels=ids).loss)
            assert loss.nll[d] / loss.tokens[d] == pytest.approx(ref, abs=1e-5)
            nll, count = nll + ref * (len(row) - 1), count + len(row) - 1
    assert int(loss.tokens.sum()) == count == held.n_tokens
    assert loss.mean == pytest.approx(nll / count, abs=1e-5)


def test_loss_windows_and_token_cap(tiny_factory):
    m = tiny_factory("llama")
    long = " ".join(["the cat sat on the mat"] * 40)
    held = held_out(m, [long, "a dog"], window=16, bos=True)
    assert all(len(r) <= 16 and r[0] == held.rows[0][0] for r in held.rows)
    assert held.doc.max() == 1 and (held.doc == 0).sum() > 1
    capped = held_out(m, [long, "a dog"], window=16, bos=True, max_tokens=5)
    assert capped.n_docs == 1 and set(capped.doc.tolist()) == {0}
    assert capped.n_tokens == 5 and len(capped.rows[0]) == 6  # cut inside the document: BOS + 5 predicted
    with pytest.raises(InputError, match="two or more tokens"):
        held_out(m, [""], window=16, bos=False)


def _docs(nll, tokens):
    return DocLoss(np.asarray(nll, dtype=float), np.asarray(tokens))


def test_used_score_and_interval():
    clean = _docs([10.0, 20.0, 30.0], [5, 10, 10])
    erased = _docs([12.0, 24.0, 33.0], [5, 10, 10])
    ctrl = [_docs([10.5, 20.0, 30.5], [5, 10, 10])]
    assert used_score(clean, erased, ctrl) == pytest.approx((69 / 25 - 61 / 25) / (60 / 25))
    assert np.isnan(used_interval(clean, erased, ctrl, 500)).all()  # 3 documents: withheld
    lo, hi = used_interval(clean, erased, ctrl, 500, min_units=2)
    assert 0 < lo <= used_score(clean, erased, ctrl) <= hi
    assert np.isnan(used_interval(clean, erased, ctrl, 0, min_units=2)[0])


def test_used_interval_needs_ten_documents_and_widens_with_the_controls_spread():
    """Documents below MIN_UNITS: NaN. Controls that agree on the mean but not with each other give
    the same score and a wider interval than identical controls, the more so the more they differ."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, 40, size=12)
    clean = _docs(2.0 * tokens + rng.normal(0, 3, 12), tokens)
    erased = _docs(clean.nll + 0.2 * tokens + rng.normal(0, 1, 12), tokens)
    nine = [_docs(x.nll[:9], tokens[:9]) for x in (clean, erased)]
    assert np.isnan(used_interval(*nine, [nine[0]], 200)).all()
    ten = [_docs(x.nll[:10], tokens[:10]) for x in (clean, erased)]
    assert np.isfinite(used_interval(*ten, [ten[0]], 200)).all()
    widths = []
    for spread in (0.0, 0.05, 0.2):
        ctrl = [_docs(clean.nll + (0.1 + d) * tokens, tokens) for d in (-spread, 0.0, spread)]
        assert used_score(clean, erased, ctrl) == pytest.approx(used_score(clean, erased, ctrl[1:2]))
        lo, hi = used_interval(clean, erased, ctrl, 2000, seed=1)
        assert lo <= used_score(clean, erased, ctrl) <= hi
        widths.append(hi - lo)
    assert widths[0] < widths[1] < widths[2] and widths[2] > 2 * widths[0]


@pytest.fixture(scope="module")
def tiny_result(tiny_factory, tmp_path_factory):
    cfg = small_causal_config(tmp_path_factory.mktemp("store"), 60, 20, 200, controls=2, bootstrap=200)
    return causal_tests(tiny_factory("llama"), cfg)


def test_a_rerun_resumes_from_the_finished_sites(tiny_factory, tmp_path, monkeypatch, capsys):
    """Each finished site's losses are kept; a rerun with the same model, settings and text
    computes no site again and gives the same table; another setting computes them anew."""
    import depthscope.analyses.causal.erasure.used as used

    cfg = small_causal_config(tmp_path / "store", controls=2, bootstrap=50)
    model = tiny_factory("llama")
    first = causal_tests(model, cfg, records=tmp_path / "sites", progress=True)
    assert "passes over the held-out text" in capsys.readouterr().err  # the expected time, said first
    assert len(list((tmp_path / "sites").rglob("*.json"))) == len(first.table)
    assert first.info["expected_seconds_erasure"] > 0

    def no_site(*a, **k):
        raise AssertionError("a finished site was computed again")

    monkeypatch.setattr(used, "_site_effect", no_site)
    again = causal_tests(model, cfg, records=tmp_path / "sites")
    pd.testing.assert_frame_equal(first.table, again.table)
    with pytest.raises(AssertionError, match="computed again"):
        causal_tests(model, CausalConfig(**{**cfg.__dict__, "controls": 3}), records=tmp_path / "sites")


def test_forwards_from_the_sites_block_equal_the_plain_forwards(tiny_factory, tiny_result, tmp_path, monkeypatch):
    """The erased and control forwards start at their site's block from the clean stream there
    (analyses/causal/erasure/prefix.py); with that turned off (every forward from the embedding) the
    table is the same, bit for bit."""
    import depthscope.hooks.late_start as prefix

    cfg = small_causal_config(tmp_path / "store", 60, 20, 200, controls=2, bootstrap=200)
    monkeypatch.setattr(prefix, "PREFIX_BYTES", 0)
    plain = causal_tests(tiny_factory("llama"), cfg)
    pd.testing.assert_frame_equal(plain.table, tiny_result.table, check_exact=True)


def test_a_streamed_model_gives_the_same_table(tiny_llama_dir, tmp_path):
    """The sites' forwards start at their block on a streamed model too (only the blocks from the
    site's on are read): the table equals the in-memory model's."""
    from depthscope.hooks import load_model

    cfg = small_causal_config(tmp_path / "store", extraction_sites=[0, 3, 6], controls=1, bootstrap=0)
    mem = causal_tests(load_model(tiny_llama_dir), cfg).table
    streamed = causal_tests(load_model(tiny_llama_dir, stream=True), cfg).table
    pd.testing.assert_frame_equal(mem, streamed, check_exact=True)


def test_causal_table_one_row_per_site_and_erased_probe_at_majority(tiny_result):
    t = tiny_result.table
    assert len(t) == 7 and list(t["label"]) == ["embed", "0.attn", "0.mlp", "1.attn", "1.mlp", "2.attn", "2.mlp"]
    for col in ("site", "layer", "sublayer", "depth", "task", "accuracy", "majority", "accuracy_erased", "used"):
        assert col in t
    assert (t["accuracy"] > t["majority"] + 0.1).all()  # something is encoded ...
    assert ((t["accuracy_erased"] - t["majority"]).abs() <= 0.03).all()  # ... and LEACE removes it
    assert (t["lm_loss"] == t["lm_loss"].iloc[0]).all()
    used = (t["lm_loss_erased"] - t["lm_loss_control_mean"]) / t["lm_loss"]
    np.testing.assert_allclose(t["used"], used, rtol=1e-9)
    assert (t["used_lo"] <= t["used_hi"]).all()
    assert (t["rank"] >= 1).all() and (t["rank"] < t["n_train"]).all()
    # the raw controls edit the fitting words as much as LEACE does, in the stream's units
    np.testing.assert_allclose(t["control_edit_rms"], t["edit_rms"], rtol=1e-4)
    assert (t["edit_rms"] > 0).all() and (t["edit_rms_text"] > 0).all() and (t["control_edit_rms_text"] > 0).all()
    # the interval names its n and method; 20 test sentences: enough documents, no note
    assert (t["ci_n"] == t["n_lm_docs"]).all() and (t["n_lm_docs"] == 20).all() and set(t["ci_unit"]) == {"documents"}
    assert t["ci_method"].iloc[0].startswith("two-level percentile bootstrap, 200 resamples: documents and the 2")
    assert t.attrs["notes"] == [] and tiny_result.info["notes"] == []


def test_report_section_only_when_the_run_has_causal_results(tiny_result, tmp_path):
    assert "causal" not in [s.key for s in build_page(tmp_path).sections]
    tiny_result.table.to_parquet(tmp_path / "causal.parquet")
    sections = build_page(tmp_path).sections
    assert [s.key for s in sections][:2] == ["probes", "causal"]
    t = tiny_result.table
    gap = (t["accuracy_erased"] - t["majority"]).abs().max()
    top = t.loc[t["used"].idxmax()]
    lines = sections[1].lines
    assert f"within {gap:.3f} of the majority" in lines[0]
    assert f"used most at {top['label']}" in lines[1] and f"of {len(t)} sites" in lines[1]


def test_report_runs_causal_only_when_asked_and_on_word_tasks(tiny_factory, tmp_path):
    assert ReportConfig().causal is False  # the main job's default is unchanged
    job = ProbeJobConfig(
        tasks=["upos", "deprel"],
        data=DataConfig(max_train_sentences=20, max_test_sentences=5),
        extraction=ExtractionConfig(sites=["embed", "2.mlp"], store_dir=str(tmp_path / "store")),
    )
    res = report_causal(tiny_factory("llama"), job, 40, Output(tmp_path / "out"), progress=False)
    t = res.tables["causal"]
    assert set(t["task"]) == {"upos"} and list(t["label"]) == ["embed", "2.mlp"]
    assert (t["n_lm_tokens"] >= 40).all() and (t["n_lm_tokens"] < 200).all()
    assert (tmp_path / "out" / "causal.parquet").is_file()
    # a few sentences: the interval of used is withheld, and the table and summary say why
    assert (t["n_lm_docs"] < 10).all() and t["used_lo"].isna().all() and t["used_hi"].isna().all()
    assert t["used"].notna().all() and (t["ci_n"] == t["n_lm_docs"]).all()
    assert any("fewer than 10" in n for n in res.summary["notes"])


def test_command_writes_the_table_and_figure(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from depthscope.probes import sample_data

    out = tmp_path / "out"
    data = sample_data()
    args = ["causal", "--model", tiny_llama_dir, "--data", data["ewt_train"], "--data", data["ewt_test"]]
    args += ["--max-train-sentences", "30", "--max-test-sentences", "8"]
    args += ["--sites", "embed,2.mlp", "--controls", "1", "--control", "whitened", "--bootstrap", "50"]
    args += ["--threads", "1", "--out", out]
    code, stdout, stderr = run_cli(args, monkeypatch, capsys)
    assert code == 0, stderr
    for name in ("causal.parquet", "causal.csv", "causal_summary.json", "causal_encoded_used.png"):
        assert (out / name).is_file()
    assert "upos" in stdout
    summary = json.loads((out / "causal_summary.json").read_text())
    assert summary["train"] == str(data["ewt_train"]) and summary["test"] == str(data["ewt_test"])
    assert summary["config"]["control"] == "whitened"
    # eight sentences and one control: no interval, and the console and the summary say why
    t = pd.read_parquet(out / "causal.parquet")
    assert set(t["control"]) == {"whitened"} and t["used_lo"].isna().all() and (t["ci_n"] == 8).all()
    assert "note: the interval of used" in stdout
    console = Console(width=250, record=True)
    console.print(summary_table(t))
    assert "no interval (8 documents)" in console.export_text()
    assert len(summary["notes"]) == 2 and "one random control" in summary["notes"][1]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--train", "no-such-file.conllu"], "no such file"),
        (["--text", "no-such-text.txt"], "no such file"),
        (["--pooling", "attn"], "one vector per word"),
        (["--task", "upos", "--controls", "0"], "controls"),
        (["--control", "aimed"], "control must be one of"),
        (["--data", "a.conllu"], "two files"),
    ],
)
def test_command_bad_input_is_a_clear_error(tmp_path, monkeypatch, capsys, extra, message):
    code, stdout, stderr = run_cli(["causal", "--out", tmp_path / "o", *extra], monkeypatch, capsys)
    assert code != 0
    assert message in (stdout + stderr)
    assert "Traceback" not in stdout + stderr
