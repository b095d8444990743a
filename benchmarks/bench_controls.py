"""How many random controls the interval of ``used`` needs (docs/causal.md), on the default model.

At a few sites, one LEACE eraser for upos (fitted on the bundled EWT train words) and a pool of
``--pool`` seeded random erasures of the same rank (``--control raw``: their edit as large as
LEACE's in the stream's units) are each applied to the held-out text (the EWT test sentences,
one document each), and every document's loss is kept. Then, for each number of controls ``C``,
``--draws`` sets of ``C`` controls are drawn from the pool (without replacement) and the interval
of ``used`` is computed as ``depthscope causal`` computes it (a two-level bootstrap over the
documents and the C controls, :func:`~depthscope.analyses.causal.erasure.loss.used_interval`). Per site
and ``C`` the table gives:

* ``width``: the interval's mean width, and ``width / most``: against the mean width with the
  most controls (where the interval stops narrowing as controls are added, more buy little);
* ``sd_controls / se_docs``: the spread of one control's loss (in units of ``used``: the loss
  over the clean loss) against the bootstrap standard error of ``used`` over the documents: the
  larger it is, the more controls are needed;
* ``cover (model)``: the interval's coverage at that spread (:func:`model_coverage`: ``used``'s
  error normal over documents and controls; the bootstrap sees only the sample variance of the
  few controls drawn, none with one control): below 0.95 the interval is too narrow;
* ``cover (docs fixed)``: how often the interval covers the pool's own ``used`` on the same
  documents (the control level alone; near 1 whenever the documents' spread dominates).

It also prints each site's edit sizes: LEACE's and the raw controls' rms on the fitting words and
on the held-out text, and the whitened controls' rms on the fitting words (``--control whitened``).

    python -m benchmarks.bench_controls [--sites 0.mlp,5.mlp,15.mlp,29.mlp] [--pool 12] [--draws 200] [--threads 1]

About 45 minutes on a loaded 2-core machine (the forward passes over the text: ``(1 + pool) x sites``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

COUNTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24)


def losses(sites: list[str], pool: int, train_sentences: int, test_sentences: int, seed: int = 0) -> dict:
    """Per site: the clean, LEACE and pool losses per held-out document, and the edits' sizes."""
    import torch

    from depthscope.analyses.causal.erasure.erasers import EditMeter, edit_rms, fit_erasure, random_erasure
    from depthscope.analyses.causal.erasure.loss import doc_nll, held_out
    from depthscope.analyses.causal.erasure.used import word_matrix
    from depthscope.hooks import load_model
    from depthscope.probes import DataConfig, ExtractionConfig, sample_data
    from depthscope.probes.encoding import encode_task
    from depthscope.probes.store.extraction import Splits, load_and_extract

    data = sample_data()
    cfg = DataConfig(max_train_sentences=train_sentences, max_test_sentences=test_sentences)
    got = load_and_extract(
        load_model(dtype=torch.float32),
        ["upos"],
        Splits(data["ewt_train"], data["ewt_test"]),
        ExtractionConfig(sites=sites),
        cfg,
        seed=seed,
        progress=False,
        keep_model=True,
    )
    m = got.loaded
    td = encode_task("upos", got.examples["upos"], got.for_task("upos"), seed=seed, resident_bytes=0)
    x = word_matrix(td.feats["train"])
    text = held_out(m, [s.text for s in got.corpora["test"].sentences], window=512)
    clean = doc_nll(m, text)
    out = {"clean": clean, "n_docs": text.n_docs, "n_tokens": text.n_tokens, "sites": {}}
    for k, label in enumerate(sites):
        t0 = time.perf_counter()
        er, fitter = fit_erasure(x[:, k], td.y["train"], td.n_classes)
        target = edit_rms(er, fitter=fitter)
        ctrl = [random_erasure(fitter, er.rank, 7919 * k + j, target_rms=target) for j in range(pool)]
        whitened = [random_erasure(fitter, er.rank, 7919 * k + j, control="whitened") for j in range(4)]
        meters = [EditMeter() for _ in range(pool + 1)]
        runs = [doc_nll(m, text, {label: e.hook(text.start, mt)}) for e, mt in zip([er, *ctrl], meters)]
        out["sites"][label] = {
            "erased": runs[0],
            "controls": runs[1:],
            "rank": er.rank,
            "edit_rms": target,
            "control_edit_rms": float(np.mean([edit_rms(c, fitter=fitter) for c in ctrl])),
            "whitened_edit_rms": float(np.mean([edit_rms(c, fitter=fitter) for c in whitened])),
            "edit_rms_text": meters[0].rms,
            "control_edit_rms_text": float(np.mean([mt.rms for mt in meters[1:]])),
            "seconds": time.perf_counter() - t0,
        }
        print(f"{label}: {pool + 1} passes in {out['sites'][label]['seconds']:.0f} s", flush=True)
    return out


def _docs_se(clean, erased, controls, n: int = 2000, seed: int = 0) -> float:
    """The bootstrap SE of ``used`` over documents alone (the controls held fixed)."""
    k = len(clean.nll)
    w = np.random.default_rng(seed).multinomial(k, np.full(k, 1.0 / k), size=n).astype(np.float64)
    tok = np.maximum(w @ clean.tokens, 1.0)
    ctrl = np.mean([w @ c.nll / tok for c in controls], 0)
    return float(np.std((w @ erased.nll / tok - ctrl) / (w @ clean.nll / tok), ddof=1))


def model_coverage(ratio: float, controls: int, level: float = 0.95, n: int = 400_000, seed: int = 0) -> float:
    """The coverage of the two-level bootstrap interval when ``used``'s error is normal: over the
    documents with SE 1, over ``controls`` controls with spread ``ratio`` (one control's SD over
    the documents' SE). The bootstrap sees the documents' variance and ``(C - 1) / C`` of the
    controls' sample variance over C (none with one control), so with few controls its
    interval is too narrow by a random factor; this is the mean coverage over that factor."""
    from scipy.stats import chi2, norm

    rng = np.random.default_rng(seed)
    c = int(controls)
    s2 = ratio**2 * chi2.rvs(c - 1, size=n, random_state=rng) / (c - 1) if c > 1 else np.zeros(n)
    seen = np.sqrt(1 + (c - 1) / c * s2 / c)
    true = np.sqrt(1 + ratio**2 / c)
    z = norm.ppf(0.5 + level / 2)
    return float(np.mean(2 * norm.cdf(z * seen / true) - 1))


def coverage(res: dict, counts=COUNTS, draws: int = 200, bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per site and number of controls: the interval's mean width, its width against the mean
    width with the most controls, how often it covers the pool's ``used`` (the documents held
    fixed), and :func:`model_coverage` at the site's measured spread (module docstring)."""
    from depthscope.analyses.causal.erasure.loss import used_interval, used_score

    clean, rows = res["clean"], []
    rng = np.random.default_rng(seed)
    for label, s in res["sites"].items():
        pool = s["controls"]
        truth = used_score(clean, s["erased"], pool)
        ratio = float(np.std([c.mean for c in pool], ddof=1) / clean.mean) / _docs_se(clean, s["erased"], pool)
        part = []
        for c in (n for n in counts if n <= len(pool)):
            widths, hits = [], 0
            for r in range(draws):
                pick = [pool[i] for i in rng.choice(len(pool), size=c, replace=False)]
                a, b = used_interval(clean, s["erased"], pick, bootstrap, seed=seed + r)
                widths.append(b - a)
                hits += a <= truth <= b
            part.append(
                {
                    "site": label,
                    "controls": c,
                    "width": float(np.mean(widths)),
                    "cover (docs fixed)": hits / draws,
                    "cover (model)": model_coverage(ratio, c),
                    "used (pool)": truth,
                    "sd_controls / se_docs": ratio,
                }
            )
        for row in part:
            row["width / most"] = row["width"] / part[-1]["width"]
        rows += part
    return pd.DataFrame(rows)


def sizes(res: dict) -> pd.DataFrame:
    """Per site: the rank and the edits' rms (raw units) on the fitting words and the text."""
    keys = ["rank", "edit_rms", "control_edit_rms", "whitened_edit_rms", "edit_rms_text", "control_edit_rms_text"]
    return pd.DataFrame([{"site": k, **{c: s[c] for c in keys}} for k, s in res["sites"].items()])


def save(res: dict, path: str) -> None:
    """Every document's summed loss and token count: clean, then per site LEACE and the pool."""
    arrays = {"clean_nll": res["clean"].nll, "tokens": res["clean"].tokens}
    for label, s in res["sites"].items():
        arrays[f"{label}/erased"] = s["erased"].nll
        arrays[f"{label}/controls"] = np.stack([c.nll for c in s["controls"]])
    np.savez(path, **arrays)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", default="0.mlp,5.mlp,15.mlp,29.mlp")
    ap.add_argument("--pool", type=int, default=12)
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--train-sentences", type=int, default=150)
    ap.add_argument("--test-sentences", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--csv", default=None, help="write the coverage table here")
    ap.add_argument("--save", default=None, help="write every document's losses here (.npz)")
    a = ap.parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    res = losses(a.sites.split(","), a.pool, a.train_sentences, a.test_sentences)
    print(f"held-out text: {res['n_docs']} documents, {res['n_tokens']} predicted tokens")
    if a.save:
        save(res, a.save)
    print(sizes(res).round(3).to_string(index=False))
    table = coverage(res, draws=a.draws)
    print(table.round(4).to_string(index=False))
    if a.csv:
        table.to_csv(a.csv, index=False)


if __name__ == "__main__":
    main()
