"""Probing: end to end against a bare forward, the batched fit against scikit-learn on every site,
and extraction memory against corpus size. UD English EWT train/test sentences, float32 probes
(``DEPTHSCOPE_PROBE_DTYPE=float32`` is set by the harness: no timing race picks the precision).

| figure | depthscope arm | baseline arm |
| --- | --- | --- |
| end to end | ``run_probes(model, "upos", train, test)`` into a fresh store (extraction, site probes with control task, scalar mixes, metrics) | the decoder body over the same sentences (BOS + tokens, length-sorted batches of <= 2048 tokens) |
| fit | ``BatchedProbe`` + ``train_probe`` + ``predict`` on all 61 sites at once | ``LogisticRegression(C=1/(2*l2*n), max_iter=100)`` fitted and evaluated on every site, looped, on the same standardised float32 features |
| accuracy gap | the largest per-site gap between the two fits (points) | |
| extraction memory | peak resident memory of ``prepare_task`` above the warm model, less the features it returns (store on disk + resident copy) | the same at a 3x smaller corpus |
"""

from __future__ import annotations

import statistics
import tempfile
import warnings

import numpy as np

from benchmarks._common import UD, Row, Settings, float32_model, interleave, mb, measure_peak, peak_memory

NAME = "probes"


def _sizes(quick: bool) -> tuple[int, int]:
    return (24, 8) if quick else (300, 100)


def _corpora(train_n: int, test_n: int):
    from depthscope.probes import read_conllu

    for name in ("en_ewt-ud-train.conllu", "en_ewt-ud-test.conllu"):
        if not (UD / name).is_file():
            raise FileNotFoundError(f"needs UD English EWT ({name}) in {UD} (or set DEPTHSCOPE_UD)")
    return (read_conllu(UD / "en_ewt-ud-train.conllu", max_sentences=train_n),
            read_conllu(UD / "en_ewt-ud-test.conllu", max_sentences=test_n))


def _bare(model, texts, batch_tokens: int = 2048):
    """The decoder body over ``texts`` (BOS first), length-sorted batches of <= batch_tokens."""
    import torch

    tok = model.tokenizer
    bos = tok.bos_token_id
    ids = [([bos] if bos is not None else []) + tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids.sort(key=len)
    body = getattr(model.hf_model, "model", model.hf_model)
    pad = tok.pad_token_id or 0
    batches, cur = [], []
    for x in ids:
        if cur and (len(cur) + 1) * len(x) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(x)
    batches.append(cur)
    tensors = []
    for b in batches:
        width = max(len(x) for x in b)
        t = torch.full((len(b), width), pad, dtype=torch.long)
        m = torch.zeros((len(b), width), dtype=torch.long)
        for k, x in enumerate(b):
            t[k, : len(x)] = torch.tensor(x)
            m[k, : len(x)] = 1
        tensors.append((t, m))

    def run():
        with torch.no_grad():
            for t, m in tensors:
                body(input_ids=t, attention_mask=m, use_cache=False)

    return run, sum(len(x) for x in ids)


def _end_to_end(model, train, test, settings: Settings) -> Row:
    from depthscope.probes import run_probes

    info = {}

    def probes():
        with tempfile.TemporaryDirectory() as store:
            res = run_probes(model, "upos", train, test, store_dir=store, progress=False)
        info["extract"] = info.get("extract", []) + [float(res.info["seconds_extract"])]
        info["fit"] = info.get("fit", []) + [float(sum(res.info["seconds_fit"].values()))]
        return res

    bare, n_tok = _bare(model, [s.text for c in (train, test) for s in c])
    t = interleave({"probes": probes, "bare": bare}, settings)
    ext, fit = statistics.median(info["extract"]), statistics.median(info["fit"])
    return Row(f"probing end to end / bare forward, {n_tok} tokens",
               f"{t['probes'].median:.2f} s ({t['probes'].spread})", f"{t['bare'].median:.2f} s ({t['bare'].spread})",
               t["probes"].ratio_to(t["bare"]), "<= 2",
               f"{len(train)}+{len(test)} sentences, 61 sites, control task + scalar mixes included; inside run_probes "
               f"(wall): extraction {ext:.2f} s, probe fitting {fit:.2f} s",
               extra={"extract_s": ext, "fit_s": fit})


def _fit(model, train, test, settings: Settings) -> list[Row]:
    import torch
    from sklearn.linear_model import LogisticRegression

    from depthscope.probes import BatchedProbe, accuracy, predict, prepare_task, train_probe
    from depthscope.probes.classifiers import DEFAULT_L2

    with tempfile.TemporaryDirectory() as store:
        td = prepare_task(model, "upos", train, test, store_dir=store, progress=False)
    ftr, fte = td.feats["train"], td.feats["test"]
    ytr, yte = td.y["train"], td.y["test"]
    S, D, C, n = ftr.n_sites, ftr.d, td.n_classes, len(ytr)
    if ftr.resident is None or ftr.resident.dtype != torch.float32:
        raise RuntimeError(f"expected resident float32 features, got {getattr(ftr.resident, 'dtype', None)}")
    Xtr = ftr.resident[:, np.argsort(ftr.order)].numpy()  # the same standardised values, example order
    Xte = fte.resident[:, np.argsort(fte.order)].numpy()
    acc = {}

    def ours():
        p = BatchedProbe(n_sites=S, d=D, n_spans=1, n_classes=C, l2=DEFAULT_L2)
        train_probe(p, ftr, torch.from_numpy(ytr))
        preds, _ = predict(p, fte)
        acc["ours"] = accuracy(preds[:, :, 0], torch.from_numpy(yte)).numpy()

    def sklearn():
        out = []
        for s in range(S):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                clf = LogisticRegression(C=1 / (2 * DEFAULT_L2 * n), max_iter=100).fit(Xtr[s], ytr)
            out.append(float((clf.predict(Xte[s]) == yte).mean()))
        acc["sklearn"] = np.array(out)

    t = interleave({"ours": ours, "sklearn": sklearn}, settings)
    gap = np.abs(acc["ours"] - acc["sklearn"]) * 100
    shape = f"{S} sites, {n} train / {len(yte)} test words, {C} classes, d {D}, l2 {DEFAULT_L2:g}, float32"
    return [
        Row("probe fit speed-up over scikit-learn (all sites)", f"{t['ours'].median:.2f} s ({t['ours'].spread})",
            f"{t['sklearn'].median:.2f} s ({t['sklearn'].spread})", 1 / t["ours"].ratio_to(t["sklearn"]), ">= 10",
            shape + "; ratio = sklearn / depthscope"),
        Row("probe accuracy gap to scikit-learn, max over sites (points)", f"mean acc {acc['ours'].mean():.4f}",
            f"mean acc {acc['sklearn'].mean():.4f}", float(gap.max()), "<= 1",
            f"worst site {int(gap.argmax())}; mean gap {gap.mean():.2f} pt"),
    ]


def memory_arm(train_n: int, test_n: int) -> dict:
    """(subprocess) Peak resident memory of ``prepare_task`` (extraction into a fresh store,
    standardised resident features) above the warm model, and the features' own bytes."""
    from depthscope.probes import prepare_task

    model = float32_model()
    train, test = _corpora(train_n, test_n)
    w_train, w_test = _corpora(2, 1)
    with tempfile.TemporaryDirectory() as store:
        prepare_task(model, "upos", w_train, w_test, store_dir=store, progress=False)  # a warm model
    holder = {}
    with tempfile.TemporaryDirectory() as store:

        def run():
            holder["td"] = prepare_task(model, "upos", train, test, store_dir=store, progress=False)

        m = measure_peak(run)
        feats = holder["td"].feats
        on_disk = sum(f.store.feats.nbytes for f in feats.values())
        resident = sum(f.resident.numel() * f.resident.element_size() for f in feats.values() if f.resident is not None)
        words = sum(len(f) for f in feats.values())
    return {"extra": m["extra"], "features": on_disk + resident, "store": on_disk, "resident": resident, "words": words}


def _memory(settings: Settings, train_n: int, test_n: int) -> Row:
    small, large = [peak_memory("bench_probes", "memory_arm", settings.threads, train_n=k * train_n // 3,
                                test_n=max(1, k * test_n // 3)) for k in (1, 3)]

    def beyond(m):
        return m["extra"] - m["features"]

    return Row(f"probe extraction memory beyond the features, {large['words']} / {small['words']} words",
               f"{mb(beyond(large)):.1f} MB (features {mb(large['features']):.1f} MB)",
               f"{mb(beyond(small)):.1f} MB (features {mb(small['features']):.1f} MB)",
               beyond(large) / max(beyond(small), 1), "<= 1.1",
               "peak resident memory of prepare_task above the warm model less its store (float16, on disk, "
               "memory-mapped) and resident float32 copy; fresh subprocess per size")


def run(settings: Settings) -> list[Row]:
    train_n, test_n = _sizes(settings.quick)
    model = float32_model()
    train, test = _corpora(train_n, test_n)
    rows = [_end_to_end(model, train, test, settings)] + _fit(model, train, test, settings)
    rows.append(_memory(settings, train_n, test_n))
    for r in rows:
        r.bench = NAME
    return rows
