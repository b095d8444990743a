"""Probing: end to end against a bare forward, the batched fit against scikit-learn on every site,
and extraction memory against corpus size. UD English EWT train/test sentences, float32 probes
(``DEPTHSCOPE_PROBE_DTYPE=float32`` is set by the harness: no timing race picks the precision).

* end to end: ``run_probes(model, "upos", train, test)`` into a fresh store (extraction, site
  probes with control task, scalar mixes, metrics) against the decoder body over the same
  sentences (BOS + tokens, length-sorted batches of <= 2048 tokens);
* (the fit against scikit-learn, both to convergence, is :mod:`benchmarks.bench_probe_fit`);
* extraction memory: how much the peak resident memory of ``prepare_task`` (above a bare
  forward's over the same sentences in the same batches) grows from one corpus to a 3x larger
  one, over how much the features it returns (store on disk + resident copy) grow: 1.0 is flat
  beyond the features. Live memory: the subprocesses fix glibc's mmap threshold at its default
  (``LIVE_MEMORY_ENV``), so a freed temporary is not kept in the heap by the dynamic threshold;
  with the dynamic threshold the same code read 0.77 to 1.58 across runs (whether a chunk's temporaries were
  retained); with it fixed, repeated runs agree within 0.3 MB.

``python -m benchmarks.bench_probes --validate`` (long, not part of the table) compares per-site
accuracy with an independent transformers + scikit-learn pipeline.
"""

from __future__ import annotations

import statistics
import tempfile
import warnings

import numpy as np

from benchmarks._common import (
    LIVE_MEMORY_ENV,
    UD,
    Row,
    Settings,
    float32_model,
    interleave,
    mb,
    measure_peak,
    peak_memory,
)

NAME = "probes"


def _sizes(quick: bool) -> tuple[int, int]:
    return (18, 6) if quick else (300, 100)


def _memory_batch_tokens(quick: bool) -> int:
    """Extraction batches for the memory figure: small enough that both corpora span several."""
    return 128 if quick else 512


def _corpora(train_n: int, test_n: int):
    from depthscope.probes import read_conllu

    for name in ("en_ewt-ud-train.conllu", "en_ewt-ud-test.conllu"):
        if not (UD / name).is_file():
            raise FileNotFoundError(f"needs UD English EWT ({name}) in {UD} (or set DEPTHSCOPE_UD)")
    return (
        read_conllu(UD / "en_ewt-ud-train.conllu", max_sentences=train_n),
        read_conllu(UD / "en_ewt-ud-test.conllu", max_sentences=test_n),
    )


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
    return Row(
        f"probing end to end / bare forward, {n_tok} tokens",
        f"{t['probes'].median:.2f} s ({t['probes'].spread})",
        f"{t['bare'].median:.2f} s ({t['bare'].spread})",
        t["probes"].ratio_to(t["bare"]),
        "<= 2",
        f"{len(train)}+{len(test)} sentences, 61 sites, control task + scalar mixes included; inside run_probes "
        f"(wall): extraction {ext:.2f} s, probe fitting {fit:.2f} s",
        extra={"extract_s": ext, "fit_s": fit},
    )


def memory_arm(train_n: int, test_n: int, batch_tokens: int, arm: str = "probes") -> dict:
    """(subprocess) Peak resident memory of ``prepare_task`` (extraction into a fresh store in
    batches of <= ``batch_tokens`` tokens, standardised resident features) above the warm model,
    and the features' own bytes."""
    from depthscope.probes import prepare_task

    model = float32_model()
    train, test = _corpora(train_n, test_n)
    if arm == "bare":
        warm, _ = _bare(model, ["A warm-up."])
        warm()
        fn, _ = _bare(model, [s.text for c in (train, test) for s in c], batch_tokens)
        return {"extra": measure_peak(fn)["extra"]}
    w_train, w_test = _corpora(2, 1)
    with tempfile.TemporaryDirectory() as store:
        prepare_task(model, "upos", w_train, w_test, store_dir=store, progress=False)  # a warm model
    holder = {}
    with tempfile.TemporaryDirectory() as store:

        def run():
            holder["td"] = prepare_task(
                model, "upos", train, test, store_dir=store, progress=False, batch_tokens=batch_tokens
            )

        m = measure_peak(run)
        feats = holder["td"].feats
        on_disk = sum(f.store.feats.nbytes for f in feats.values())
        resident = sum(f.resident.numel() * f.resident.element_size() for f in feats.values() if f.resident is not None)
        words = sum(len(f) for f in feats.values())
    return {"extra": m["extra"], "features": on_disk + resident, "store": on_disk, "resident": resident, "words": words}


#: subprocesses per arm and size of the memory figure (the median is used: a single peak moves by ~10 MB)
MEMORY_REPEATS = 3


def _memory(settings: Settings, train_n: int, test_n: int) -> Row:
    bt = _memory_batch_tokens(settings.quick)

    def arm(k: int, name: str) -> dict:
        """The median-``extra`` of ``MEMORY_REPEATS`` fresh subprocesses (the others' fields are equal)."""
        got = [
            peak_memory(
                "bench_probes",
                "memory_arm",
                settings.threads,
                train_n=k * train_n // 3,
                test_n=max(1, k * test_n // 3),
                batch_tokens=bt,
                arm=name,
                env=LIVE_MEMORY_ENV,
            )
            for _ in range(MEMORY_REPEATS)
        ]
        return sorted(got, key=lambda m: m["extra"])[len(got) // 2]

    small, large = arm(1, "probes"), arm(3, "probes")
    for m, k in ((small, 1), (large, 3)):
        m["bare"] = arm(k, "bare")["extra"]

    def own(m):  # the extraction's peak above a bare forward over the same batches
        return m["extra"] - m["bare"]

    grow, feats = own(large) - own(small), large["features"] - small["features"]
    return Row(
        f"probe extraction memory growth / feature growth, {large['words']} vs {small['words']} words",
        f"+{mb(grow):.1f} MB peak ({mb(own(small)):.1f} -> {mb(own(large)):.1f} MB)",
        f"+{mb(feats):.1f} MB features ({mb(small['features']):.1f} -> {mb(large['features']):.1f} MB)",
        grow / max(feats, 1),
        "<= 1.1",
        "peak resident memory of prepare_task above a bare forward's peak over the same batches "
        f"({mb(small['bare']):.1f} / {mb(large['bare']):.1f} MB), against the growth of the features it returns "
        f"(float16 store on disk, memory-mapped, + resident float32 copy); 1.0 = flat beyond the features; "
        f"extraction batches of <= {bt} tokens; median of {MEMORY_REPEATS} fresh subprocesses per arm and size, "
        "glibc's mmap threshold fixed (live memory, no retained temporaries)",
    )


def run(settings: Settings) -> list[Row]:
    train_n, test_n = _sizes(settings.quick)
    model = float32_model()
    train, test = _corpora(train_n, test_n)
    rows = [_end_to_end(model, train, test, settings)]
    rows.append(_memory(settings, train_n, test_n))
    for r in rows:
        r.bench = NAME
    return rows


# ----------------------------------------------------------------------------- validation (not timed)
def validate(model, args):
    """depthscope's per-site upos accuracy vs an independent pipeline (transformers
    ``output_hidden_states`` at block outputs, its own last-subword lookup, scikit-learn)."""
    import time

    import torch
    from sklearn.linear_model import LogisticRegression

    from depthscope.probes import read_conllu, run_probes
    from depthscope.probes.solvers.classifiers import DEFAULT_L2

    train = read_conllu(UD / "en_ewt-ud-train.conllu", max_sentences=args.validate_train)
    test = read_conllu(UD / "en_ewt-ud-test.conllu", max_sentences=args.validate_test)
    t = time.perf_counter()
    res = run_probes(model, "upos", train, test, store_dir=args.store, bos=not args.no_bos, progress=False)
    print(f"run_probes: {time.perf_counter() - t:.0f} s", flush=True)
    from depthscope.probes.corpora.spans import bos_id

    prepend = None if args.no_bos else bos_id(model.tokenizer)
    bs = res.by_site.set_index("label")
    print(res.summary.T.to_string(), flush=True)
    layers = [int(x) for x in args.validate_layers.split(",")]
    seen = {s.text for s in train}
    test_sents = [s for s in test if s.text not in seen]

    def feats(corpus):
        xs, ys = {l: [] for l in layers}, []
        body = model.hf_model.model
        tok = model.tokenizer
        for a in range(0, len(corpus), 16):
            part = corpus[a : a + 16]
            tok.padding_side = "right"
            enc = tok([s.text for s in part], return_offsets_mapping=True, return_tensors="pt", padding=True)
            if prepend is not None:  # the BOS run_probes prepends, as a first column
                B = len(part)
                enc = {
                    "input_ids": torch.cat([torch.full((B, 1), prepend), enc["input_ids"]], 1),
                    "attention_mask": torch.cat([torch.ones(B, 1, dtype=torch.long), enc["attention_mask"]], 1),
                    "offset_mapping": torch.cat([torch.zeros(B, 1, 2, dtype=torch.long), enc["offset_mapping"]], 1),
                }
            with torch.no_grad():
                hs = body(
                    input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], output_hidden_states=True
                ).hidden_states
            for b, s in enumerate(part):
                real = enc["attention_mask"][b].bool().numpy()
                st, en = enc["offset_mapping"][b, :, 0].numpy(), enc["offset_mapping"][b, :, 1].numpy()
                for w in s.words:
                    last = max(i for i in range(len(en)) if real[i] and st[i] < w.end and en[i] > w.start)
                    for l in layers:
                        xs[l].append(hs[l][b, last].numpy())
                    ys.append(w.upos)
        return {l: np.stack(v) for l, v in xs.items()}, np.array(ys)

    xtr, ytr = feats(list(train))
    xte, yte = feats(test_sents)
    print(f"independent features: {len(ytr)} train / {len(yte)} test words", flush=True)
    for l in layers:
        label = "embed" if l == 0 else f"{l - 1}.mlp"
        mu, sd = xtr[l].mean(0), xtr[l].std(0)
        sd[sd < 1e-6] = 1
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            clf = LogisticRegression(C=1 / (2 * DEFAULT_L2 * len(ytr)), max_iter=args.validate_iter)
            clf.fit((xtr[l] - mu) / sd, ytr)
        ref = float((clf.predict((xte[l] - mu) / sd) == yte).mean())
        ours = float(bs.loc[label, "accuracy"])
        print(
            f"hidden_states[{l:2d}] = {label:7s}: sklearn {ref:.4f}  depthscope {ours:.4f}  "
            f"gap {100 * (ours - ref):+.2f} pt"
            f"  (control {bs.loc[label, 'control_accuracy']:.4f}, selectivity {bs.loc[label, 'selectivity']:.4f}; "
            f"sklearn {time.perf_counter() - t:.0f} s)",
            flush=True,
        )


def main() -> None:
    """``python -m benchmarks.bench_probes --validate``: accuracy against an independent pipeline (long)."""
    import argparse

    ap = argparse.ArgumentParser(description=validate.__doc__)
    ap.add_argument("--validate", action="store_true", required=True)
    ap.add_argument("--validate-train", type=int, default=2000)
    ap.add_argument("--validate-test", type=int, default=500)
    ap.add_argument(
        "--validate-layers", default="0,3,9,15,21,27", help="hidden_states indices (0 = embed, l = (l-1).mlp)"
    )
    ap.add_argument("--validate-iter", type=int, default=300)
    ap.add_argument("--store", default=None, help="activation store (reused on re-runs)")
    ap.add_argument("--no-bos", action="store_true", help="without the prepended BOS token")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    Settings(threads=args.threads).pin()
    warnings.filterwarnings("ignore")
    validate(float32_model(), args)


if __name__ == "__main__":
    main()
