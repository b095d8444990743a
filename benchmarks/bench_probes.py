"""Cost of the probing suite against baselines measured in the same run (real default model,
UD English EWT sentences from ../shared/data/ud).

    python benchmarks/bench_probes.py [--quick] [--train-sentences 300] [--test-sentences 100]
                                      [--sklearn-sites 4] [--full-sklearn] [--validate]

1. End to end: ``run_probes(model, "upos", ...)`` with a fresh activation store (extraction,
   site probes with control task, cumulative scalar mixes, metrics) against a bare batched
   forward of the decoder body (transformers, no hooks, no LM head) over the same sentences in
   the same length-sorted batches. Goal: ratio <= 2. Also shown: ``upos,deprel`` sharing one
   extraction, and the run repeated with the store reused.
2. Linear probes at every site in one batched fit against scikit-learn
   ``LogisticRegression(C=1/(2*l2*n))`` (lbfgs, ``max_iter=100``) looped over sites on the same
   standardised features. sklearn is timed on ``--sklearn-sites`` evenly spaced sites and its
   per-site mean is multiplied by the number of sites (``--full-sklearn`` loops over all).
   Goals: speedup >= 10, accuracy gap <= 1 point at every compared site.
3. Extraction throughput (tokens/s) against the bare forward's.

``--validate`` (long; run it in the background) instead compares depthscope's per-site upos
accuracy (EWT 2000 train / 500 test sentences by default) with an independent pipeline:
transformers ``output_hidden_states`` at block outputs, its own last-subword lookup, sklearn.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import UD, env_line  # noqa: E402


def bare_forward(model, texts, batch_tokens=2048):
    """The decoder body over ``texts``, batched like the extraction (length-sorted, right
    padding, the BOS token run_probes prepends when the tokenizer adds none)."""
    from depthscope.probes.activations import _batches
    from depthscope.probes.spans import bos_id

    tok = model.tokenizer
    first = bos_id(tok)
    ids = [([first] if first is not None else []) + tok(t)["input_ids"] for t in texts]
    lengths = np.array([len(x) for x in ids])
    body = getattr(model.hf_model, "model", model.hf_model)
    pad = tok.pad_token_id or 0
    t0 = time.perf_counter()
    for b in _batches(lengths, batch_tokens):
        width = int(lengths[b].max())
        x = torch.full((len(b), width), pad, dtype=torch.long)
        m = torch.zeros((len(b), width), dtype=torch.long)
        for k, p in enumerate(b):
            x[k, : lengths[p]] = torch.tensor(ids[p])
            m[k, : lengths[p]] = 1
        with torch.no_grad():
            body(input_ids=x, attention_mask=m, use_cache=False)
    return time.perf_counter() - t0, int(lengths.sum())


def end_to_end(model, args, train, test):
    from depthscope.probes import run_probes

    texts = [s.text for c in (train, test) for s in c]
    bare_forward(model, texts[:8])  # warm-up
    t_bare1, n_tok = bare_forward(model, texts)
    with tempfile.TemporaryDirectory() as store:
        t = time.perf_counter()
        res = run_probes(model, "upos", train, test, store_dir=store, progress=False)
        t_e2e = time.perf_counter() - t
        t = time.perf_counter()
        run_probes(model, "upos", train, test, store_dir=store, progress=False)
        t_reuse = time.perf_counter() - t
    t_bare2, _ = bare_forward(model, texts)
    with tempfile.TemporaryDirectory() as store:
        t = time.perf_counter()
        run_probes(model, "upos,deprel", train, test, store_dir=store, progress=False)
        t_two = time.perf_counter() - t
    t_bare = min(t_bare1, t_bare2)
    ext_tok = sum(res.info["extraction_tokens"].values())
    print(
        f"\n1. end to end ({len(train)} train + {len(test)} test sentences, {n_tok} tokens, "
        f"{res.summary['n_train'].iloc[0]} + {res.summary['n_test'].iloc[0]} words, {model.n_sites} sites)"
    )
    print(
        f"   bare batched forward (decoder body)      {t_bare:8.1f} s   ({n_tok / t_bare:.0f} tok/s; runs {t_bare1:.1f}, {t_bare2:.1f})"
    )
    print(f"   run_probes upos, fresh store             {t_e2e:8.1f} s   ratio {t_e2e / t_bare:.2f}  (goal <= 2)")
    print(
        f"     of which extraction {res.info['seconds_extract']:.1f} s, probes {sum(res.info['seconds_fit'].values()):.1f} s"
    )
    print(f"   run_probes upos, store reused            {t_reuse:8.1f} s   ratio {t_reuse / t_bare:.2f}")
    print(f"   run_probes upos,deprel (one extraction)  {t_two:8.1f} s   ratio {t_two / t_bare:.2f}")
    print(
        f"\n3. extraction: {ext_tok / res.info['seconds_extract']:.0f} tok/s (incl. tokenising, gathering, "
        f"float16 store writes) vs bare forward {n_tok / t_bare:.0f} tok/s"
    )
    return res


def fit_speed(model, args, train, test):
    from sklearn.linear_model import LogisticRegression

    from depthscope.probes import BatchedProbe, accuracy, predict, prepare_task, train_probe
    from depthscope.probes.classifiers import DEFAULT_L2

    with tempfile.TemporaryDirectory() as store:
        td = prepare_task(model, "upos", train, test, store_dir=store, progress=False)
        ftr, fte = td.feats["train"], td.feats["test"]
        ytr, yte = td.y["train"], td.y["test"]
        S, D, C, n = ftr.n_sites, ftr.d, td.n_classes, len(ytr)
        t = time.perf_counter()
        p = BatchedProbe(n_sites=S, d=D, n_spans=1, n_classes=C, l2=DEFAULT_L2)
        train_probe(p, ftr, torch.from_numpy(ytr))
        preds, _ = predict(p, fte)
        t_ours = time.perf_counter() - t
        ours = accuracy(preds[:, :, 0], torch.from_numpy(yte)).numpy()
        # the same standardised features, site by site, for sklearn
        Xtr = ftr.resident[:, np.argsort(ftr.order)].float().numpy()
        Xte = fte.resident[:, np.argsort(fte.order)].float().numpy()
        sites = (
            list(range(S))
            if args.full_sklearn
            else np.linspace(0, S - 1, args.sklearn_sites).round().astype(int).tolist()
        )
        times, gaps = [], []
        print(
            f"\n2. linear probes, {S} sites, n_train {n}, n_test {len(yte)}, {C} classes, l2 {DEFAULT_L2:g}, "
            f"features {str(ftr.resident.dtype).replace('torch.', '')} (sklearn: the same values in float32)"
        )
        print(f"   depthscope batched fit + predict, all sites  {t_ours:8.1f} s")
        for s in sites:
            t = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                clf = LogisticRegression(C=1 / (2 * DEFAULT_L2 * n), max_iter=100).fit(Xtr[s], ytr)
            ref = float((clf.predict(Xte[s]) == yte).mean())
            times.append(time.perf_counter() - t)
            gaps.append(abs(float(ours[s]) - ref))
            print(
                f"   site {s:2d}: sklearn {times[-1]:6.1f} s  acc {ref:.4f}   depthscope acc {ours[s]:.4f}   "
                f"gap {100 * gaps[-1]:.2f} pt"
            )
        t_sk = float(np.mean(times)) * S
        print(
            f"   sklearn looped over {S} sites: {t_sk:.1f} s ({'measured' if args.full_sklearn else f'mean of {len(sites)} sites x {S}'})"
        )
        print(f"   speedup {t_sk / t_ours:.1f}x (goal >= 10), max accuracy gap {100 * max(gaps):.2f} pt (goal <= 1)")


def validate(model, args):
    """depthscope vs an independent sklearn pipeline on HF hidden states (block outputs)."""
    from sklearn.linear_model import LogisticRegression

    from depthscope.probes import read_conllu, run_probes
    from depthscope.probes.classifiers import DEFAULT_L2

    train = read_conllu(UD / "en_ewt-ud-train.conllu", max_sentences=args.validate_train)
    test = read_conllu(UD / "en_ewt-ud-test.conllu", max_sentences=args.validate_test)
    t = time.perf_counter()
    res = run_probes(model, "upos", train, test, store_dir=args.store, bos=not args.no_bos, progress=False)
    print(f"run_probes: {time.perf_counter() - t:.0f} s", flush=True)
    from depthscope.probes.spans import bos_id

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
            clf = LogisticRegression(C=1 / (2 * DEFAULT_L2 * len(ytr)), max_iter=args.validate_iter).fit(
                (xtr[l] - mu) / sd, ytr
            )
        ref = float((clf.predict((xte[l] - mu) / sd) == yte).mean())
        ours = float(bs.loc[label, "accuracy"])
        print(
            f"hidden_states[{l:2d}] = {label:7s}: sklearn {ref:.4f}  depthscope {ours:.4f}  gap {100 * (ours - ref):+.2f} pt"
            f"  (control {bs.loc[label, 'control_accuracy']:.4f}, selectivity {bs.loc[label, 'selectivity']:.4f}; "
            f"sklearn {time.perf_counter() - t:.0f} s)",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100 train / 40 test sentences, 3 sklearn sites")
    ap.add_argument("--train-sentences", type=int, default=300)
    ap.add_argument("--test-sentences", type=int, default=100)
    ap.add_argument("--sklearn-sites", type=int, default=4)
    ap.add_argument("--full-sklearn", action="store_true", help="loop sklearn over every site (slow)")
    ap.add_argument("--validate", action="store_true", help="long validation against sklearn on HF hidden states")
    ap.add_argument("--validate-train", type=int, default=2000)
    ap.add_argument("--validate-test", type=int, default=500)
    ap.add_argument(
        "--validate-layers", default="0,3,9,15,21,27", help="hidden_states indices (0 = embed, l = (l-1).mlp)"
    )
    ap.add_argument("--validate-iter", type=int, default=300)
    ap.add_argument("--store", default=None, help="activation store for --validate (reused on re-runs)")
    ap.add_argument("--no-bos", action="store_true", help="--validate without the prepended BOS token")
    ap.add_argument(
        "--no-tune",
        action="store_true",
        help="keep glibc's default allocator thresholds "
        "(the depthscope command raises them; see depthscope.hooks.tune_allocator)",
    )
    args = ap.parse_args()
    from depthscope.hooks import tune_allocator
    from depthscope.probes.classifiers import compute_dtype

    tuned = False if args.no_tune else tune_allocator()
    if args.quick:
        args.train_sentences, args.test_sentences, args.sklearn_sites = 100, 40, 3
    warnings.filterwarnings("ignore")
    from depthscope.hooks import load_model
    from depthscope.probes import read_conllu

    model = load_model()
    print(env_line(), "|", repr(model), f"| allocator tuned: {tuned}, probe dtype: {compute_dtype()}")
    if args.validate:
        validate(model, args)
        return
    if not (UD / "en_ewt-ud-train.conllu").is_file():
        raise SystemExit(f"needs UD English EWT in {UD}")
    train = read_conllu(UD / "en_ewt-ud-train.conllu", max_sentences=args.train_sentences)
    test = read_conllu(UD / "en_ewt-ud-test.conllu", max_sentences=args.test_sentences)
    end_to_end(model, args, train, test)
    fit_speed(model, args, train, test)


if __name__ == "__main__":
    main()
