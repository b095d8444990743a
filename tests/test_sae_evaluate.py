"""``evaluate_sae`` (analyses/features/evaluate.py) against a hand computation on the plain
transformers model: a forward hook on the decoder layer replaces its output at every position but
the first with the hand-written SAE reconstruction, zeros or the mean, one window at a time without
padding; the losses, SAELens's CE loss score, the KL and the reconstruction numbers follow from
their definitions. And the hostile cases of attaching an SAE (issue 57): a width mismatch is an
error naming the SAE and the point, an SAE recorded for another hook a warning."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from depthscope.analyses import TextWindows, evaluate_sae
from depthscope.analyses.causal.erasure.loss import held_out
from depthscope.common.errors import InputError
from depthscope.hooks import load_sae, save_sae
from tests.test_sae import hand_encode, random_sae

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [
    "The cat sat on the mat. The dog sat on the log.",
    "Hello world, this is a longer second sentence with more words.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A bird flew over the house and sang.",
]


@pytest.fixture(scope="module")
def llama(tiny_factory):
    return tiny_factory("llama", n_layers=3)


def _run(model, row, layer: int, edit=None):
    """Logits ``[pos, vocab]`` of one window and the layer's output ``[pos, d]`` before ``edit``
    (a function of that output replacing it)."""
    seen = {}

    def hook(mod, args, out):
        h = out[0] if isinstance(out, tuple) else out
        seen["y"] = h[0].clone()
        if edit is None:
            return None
        new = edit(h)
        return (new, *out[1:]) if isinstance(out, tuple) else new

    handle = model.hf_model.model.layers[layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model.hf_model(input_ids=torch.as_tensor(row)[None]).logits[0]
    finally:
        handle.remove()
    return logits, seen["y"]


def _after_first(h, value):
    out = h.clone()
    out[:, 1:] = value(h[:, 1:])
    return out


def _nll(logits, row) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:-1].double(), torch.as_tensor(row[1:]), reduction="sum")


def test_evaluate_sae_equals_the_hand_computation(llama):
    sae = random_sae(llama.d_model, 48, "topk", k=6, hook_name="blocks.1.hook_resid_post")
    text = TextWindows(window=10)
    rows = held_out(llama, DOCS, text=text).rows
    recon = lambda x: hand_encode(sae, x) @ sae.W_dec + sae.b_dec  # noqa: E731
    clean = [_run(llama, r, 1) for r in rows]
    ys = torch.cat([y[1:] for _, y in clean]).double()
    mean = ys.mean(0)
    loss = {k: 0.0 for k in ("clean", "spliced", "zero", "mean")}
    kl, n = 0.0, 0
    for r, (logits, _) in zip(rows, clean):
        spliced, _ = _run(llama, r, 1, lambda h: _after_first(h, recon))
        zero, _ = _run(llama, r, 1, lambda h: _after_first(h, torch.zeros_like))
        ablated, _ = _run(llama, r, 1, lambda h: _after_first(h, lambda x: mean.float().expand_as(x)))
        for k, lg in (("clean", logits), ("spliced", spliced), ("zero", zero), ("mean", ablated)):
            loss[k] += float(_nll(lg, r))
        p, q = torch.log_softmax(logits[:-1].double(), -1), torch.log_softmax(spliced[:-1].double(), -1)
        kl += float((p.exp() * (p - q)).sum())
        n += len(r) - 1
    loss = {k: v / n for k, v in loss.items()}
    feats = hand_encode(sae, ys.float())
    got = evaluate_sae(llama, sae, DOCS, text=text, batch_size=3).iloc[0]
    assert got["label"] == "1.mlp" and got["depth"] == 2.0 and got["eval_tokens"] == n == len(ys)
    for k in loss:
        assert got[f"loss_{k}"] == pytest.approx(loss[k], abs=1e-5), k
    assert got["ce_loss_score"] == pytest.approx(
        (loss["zero"] - loss["spliced"]) / (loss["zero"] - loss["clean"]), abs=1e-4
    )
    assert got["ce_loss_score_mean"] == pytest.approx(
        (loss["mean"] - loss["spliced"]) / (loss["mean"] - loss["clean"]), abs=1e-4
    )
    assert got["kl"] == pytest.approx(kl / n, abs=1e-5) and got["kl"] > 0
    err = (ys - recon(ys.float()).double()).pow(2).sum()
    assert got["variance_explained"] == pytest.approx(float(1 - err / (ys - mean).pow(2).sum()), abs=1e-5)
    assert got["l0"] == pytest.approx(float((feats > 0).sum(-1).double().mean()), abs=1e-9)
    assert got["dead_fraction"] == pytest.approx(float((~(feats > 0).any(0)).double().mean()), abs=1e-9)


def test_a_perfect_sae_scores_one_and_a_saved_one_evaluates_alike(llama, tmp_path):
    d = llama.d_model
    eye = torch.eye(d)
    identity = random_sae(d, 2 * d, "standard", hook_name="blocks.0.hook_resid_post")
    identity.W_enc, identity.b_enc = torch.cat([eye, -eye], 1), torch.zeros(2 * d)
    identity.W_dec, identity.b_dec = torch.cat([eye, -eye], 0), torch.zeros(d)  # relu(x) - relu(-x) = x
    got = evaluate_sae(llama, identity, DOCS).iloc[0]
    assert got["ce_loss_score"] == pytest.approx(1.0, abs=1e-4) and got["kl"] == pytest.approx(0.0, abs=1e-6)
    assert got["variance_explained"] == pytest.approx(1.0, abs=1e-5)
    sae = random_sae(d, 32, "topk", k=4, hook_name="blocks.0.hook_resid_post")
    loaded = load_sae(save_sae(sae, tmp_path / "sae"))
    a, b = evaluate_sae(llama, sae, DOCS), evaluate_sae(llama, loaded, DOCS)
    cols = ["variance_explained", "l0", "dead_fraction", "loss_spliced", "ce_loss_score", "kl"]
    np.testing.assert_allclose(a[cols].to_numpy(float), b[cols].to_numpy(float), rtol=1e-6)


def test_attaching_an_sae_checks_it_against_the_point(llama, tmp_path, caplog):
    wide = load_sae(
        save_sae(random_sae(llama.d_model + 8, 16, "standard", hook_name="blocks.1.hook_resid_post"), tmp_path / "w")
    )
    for call in (
        lambda: evaluate_sae(llama, wide, DOCS),
        lambda: llama.run(DOCS[:1], saes={"1.mlp": wide}),
    ):
        with pytest.raises(InputError, match=r"reads d_in=72, but the point 1\.mlp holds 64 values") as e:
            call()
        assert str(tmp_path / "w") in str(e.value)  # the SAE is named by its folder
    elsewhere = random_sae(llama.d_model, 16, "standard", hook_name="blocks.1.hook_resid_post")
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        evaluate_sae(llama, elsewhere, DOCS[:1], point="0.mlp")
    assert "recorded for the hook 'blocks.1.hook_resid_post' (1.mlp) but is attached at 0.mlp" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        evaluate_sae(llama, elsewhere, DOCS[:1])  # at its own hook: no warning
    assert "recorded for" not in caplog.text
    with pytest.raises(InputError, match="not an SAE"):
        evaluate_sae(llama, "sae", DOCS)


def test_a_transcoder_is_spliced_where_it_writes(llama):
    """A transcoder reads the MLP's input and writes its output: the spliced and zero-ablated losses
    against a hook on the MLP module, the variance explained of the MLP's output."""
    tc = random_sae(llama.d_model, 40, "transcoder", hook_name="blocks.1.ln2.hook_normalized")
    rows = held_out(llama, DOCS).rows
    recon = lambda x: hand_encode(tc, x) @ tc.W_dec + tc.b_dec  # noqa: E731
    mlp = llama.hf_model.model.layers[1].mlp
    edits = {"spliced": lambda x, out: recon(x), "zero": lambda x, out: torch.zeros_like(out)}
    loss, outs, errs, n = dict.fromkeys(edits, 0.0), [], [], 0
    for r in rows:
        for k, edit in edits.items():
            seen = []

            def hook(mod, args, out, edit=edit, seen=seen):
                new = out.clone()
                new[:, 1:] = edit(args[0][:, 1:], out[:, 1:])
                seen.append((out[0, 1:], (out - recon(args[0]))[0, 1:]))
                return new

            h = mlp.register_forward_hook(hook)
            try:
                with torch.no_grad():
                    logits = llama.hf_model(input_ids=torch.as_tensor(r)[None]).logits[0]
            finally:
                h.remove()
            loss[k] += float(_nll(logits, r))
        outs.append(seen[0][0])  # the clean MLP output (block 1 is reached before any edit)
        errs.append(seen[0][1])
        n += len(r) - 1
    got = evaluate_sae(llama, tc, DOCS).iloc[0]
    assert got["point"] == "1.mlp_in" and got["eval_tokens"] == n
    assert got["loss_spliced"] == pytest.approx(loss["spliced"] / n, abs=1e-5)
    assert got["loss_zero"] == pytest.approx(loss["zero"] / n, abs=1e-5)
    y, e = torch.cat(outs).double(), torch.cat(errs).double()
    want = 1 - float(e.pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    assert got["variance_explained"] == pytest.approx(want, rel=1e-6)
