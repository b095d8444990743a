"""DAS per site against pyvene's DAS on the same site and data, and both against the floor (issue 56).

Task: subject-verb number agreement on the default model (``agreement_examples``, seed 1: 200
train and 100 test examples), one direction (``dim=1``) at the subject position, one epoch, Adam
at 0.01, batches of at most 32 examples of one token length, one torch thread.

==============  ===================================================================================
figure          what is measured
==============  ===================================================================================
depthscope      :func:`~depthscope.analyses.das` over ``SITES`` sites (``--quick``: 3; full: all 61
                residual sites): the source vectors read once, each step one forward of the
                positions from the subject on (the key/value cache before it computed once) and
                one backward down to the site; seconds per site
baseline        pyvene 0.1.8 (``LowRankRotatedSpaceIntervention``, rank 1: the same
                parametrisation) at ``block_output`` of the same layers (pyvene has no site between
                attention and MLP), in its own virtual environment when pyvene is not importable
                here (``--pyvene-python``): each step runs the source's forward, then the base's
                whole forward with the swap, then the backward; seconds per site
floor           the products a DAS step cannot avoid, at this machine's peak rate for one large
                float32 product on one thread (as ``bench_job_flops``): per example and epoch the
                blocks after the site on the positions from the subject on, forward and backward
                (no weight gradients: one product each way), plus the unembedding of the last
                position both ways; once per example, the forward of base and source up to the site.
                The rows give each tool's seconds as a multiple of its floor.
==============  ===================================================================================

    python -m benchmarks.bench_das [--quick] [--pyvene-python /path/to/venv/bin/python]

``run(quick) -> list[dict]`` returns the rows for ``python -m benchmarks``. The IIA on the test
examples is printed for both (they need not agree to the digit: the initial bases differ).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

N_TRAIN, N_TEST, SEED, LR, BATCH = 200, 100, 1, 0.01, 32
QUICK_LAYERS = (4, 14, 24)
PYVENE_LAYERS = {True: (14,), False: (4, 14, 24)}
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PYVENE = os.environ.get("DEPTHSCOPE_PYVENE_PYTHON", "/tmp/pyvene-venv/bin/python")


def _data(model):
    from depthscope.analyses import agreement_examples

    exs = agreement_examples(model, N_TRAIN + N_TEST, seed=SEED)
    return exs[:N_TRAIN], exs[N_TRAIN:]


def peak_rate(n: int = 1536) -> float:
    """FLOP/s of one large float32 product on this thread (the best of five, after a warm-up)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def floor_flops(model, train, site: int) -> float:
    """The products one epoch of DAS at ``site`` (subject position) cannot avoid (module docstring)."""
    from depthscope.analyses.causal.variables.counterfactuals import tokenize_examples

    hf = model.hf_model
    blocks = hf.model.layers
    attn = sum(p.numel() for n, p in blocks[0].named_parameters() if "self_attn" in n and p.dim() == 2)
    mlp = sum(p.numel() for n, p in blocks[0].named_parameters() if "mlp" in n and p.dim() == 2)
    n_layers = len(blocks)
    # residual site s: embed (0), l.attn (2l+1), l.mlp (2l+2); the parameters read after it, per token
    if site == 0:
        after = n_layers * (attn + mlp)
    elif site % 2:
        after = mlp + (n_layers - 1 - (site - 1) // 2) * (attn + mlp)
    else:
        after = (n_layers - 1 - (site - 2) // 2) * (attn + mlp)
    before = n_layers * (attn + mlp) - after
    head = model.d_model * model.vocab_size
    total = 0.0
    for e in tokenize_examples(model, train, ["SUBJ"]):
        p = e.positions["SUBJ"][0]
        tail = len(e.base_ids) - p
        total += 2 * (2 * after * tail + 2 * head)  # forward and backward (activations only)
        total += 2 * before * (p + 1 + e.positions["SUBJ"][1] + 1)  # base and source up to the site, once
    return total


def depthscope_seconds(model, train, test, layers) -> tuple[float, list[float]]:
    """Seconds per site of :func:`das` at ``{l}.mlp`` for ``layers`` (one call), and the IIAs."""
    from depthscope.analyses import das
    from depthscope.analyses.causal.variables.config import LocalizeConfig

    cfg = LocalizeConfig(epochs=1, lr=LR, batch_size=BATCH, seed=SEED)
    sites = ",".join(f"{layer}.mlp" for layer in layers) if layers else "resid"
    t = time.perf_counter()
    res = das(model, train, test, sites=sites, positions="SUBJ", dim=1, config=cfg)
    secs = time.perf_counter() - t
    return secs / len(res.table), res.table["iia"].tolist()


def pyvene_seconds(python: str, layers, quick: bool) -> dict | None:
    """Run :func:`_pyvene_main` in ``python`` (a venv with pyvene); its JSON result, or None."""
    cmd = [python, str(Path(__file__).resolve()), "--as-pyvene", "--layers", ",".join(map(str, layers))]
    with tempfile.TemporaryDirectory(prefix="depthscope-shim-") as shim:
        # the other venv has no depthscope: this checkout's packages, named as installed, go on its path
        (Path(shim) / "depthscope").mkdir()
        root = Path(__file__).resolve().parents[1]
        for part in ("common", "hooks", "probes", "analyses"):
            (Path(shim) / "depthscope" / part).symlink_to(root / part)
        path = os.pathsep.join(p for p in (shim, str(root), os.environ.get("PYTHONPATH", "")) if p)
        try:
            out = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path}, timeout=3600, check=True
            )
        except (OSError, subprocess.SubprocessError) as e:
            print(f"pyvene could not run ({type(e).__name__}): {getattr(e, 'stderr', '')[-800:]}", file=sys.stderr)
            return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def _pyvene_main(layers: list[int]) -> None:
    """In pyvene's environment: DAS at ``block_output`` of each layer, the same data and settings."""
    import pyvene as pv

    from depthscope.analyses.causal.variables.counterfactuals import tokenize_examples
    from depthscope.hooks import load_model

    torch.set_num_threads(1)
    model = load_model()
    hf = model.hf_model
    train, test = _data(model)
    groups = {}
    for split, exs in (("train", train), ("test", test)):
        for e in tokenize_examples(model, exs, ["SUBJ"]):
            key = (split, len(e.base_ids), len(e.source_ids), e.positions["SUBJ"])
            groups.setdefault(key, []).append(e)
    batches = {"train": [], "test": []}
    for (split, _, _, (pb, ps)), es in groups.items():
        for k in range(0, len(es), BATCH):
            chunk = es[k : k + BATCH]
            base = torch.stack([e.base_ids for e in chunk])
            src = torch.stack([e.source_ids for e in chunk])
            label = torch.tensor([e.candidates[e.label] for e in chunk])
            cands = torch.tensor([e.candidates for e in chunk])
            batches[split].append((base, src, pb, ps, label, cands, torch.tensor([e.label for e in chunk])))
    out = {"seconds": [], "iia": []}
    for layer in layers:
        torch.manual_seed(SEED)
        cfg = pv.IntervenableConfig(
            representations=[{"layer": layer, "component": "block_output", "low_rank_dimension": 1}],
            intervention_types=pv.LowRankRotatedSpaceIntervention,
        )
        ivm = pv.IntervenableModel(cfg, hf)
        ivm.disable_model_gradients()
        opt = torch.optim.Adam(ivm.get_trainable_parameters(), lr=LR)
        t = time.perf_counter()
        for base, src, pb, ps, label, _, _ in batches["train"]:
            n = len(base)
            loc = {"sources->base": ([[[ps]] * n], [[[pb]] * n])}
            _, cf = ivm({"input_ids": base}, [{"input_ids": src}], loc)
            loss = torch.nn.functional.cross_entropy(cf.logits[:, -1].float(), label)
            opt.zero_grad()
            loss.backward()
            opt.step()
        out["seconds"].append(time.perf_counter() - t)
        hits = n_all = 0
        with torch.no_grad():
            for base, src, pb, ps, _, cands, lab in batches["test"]:
                n = len(base)
                _, cf = ivm({"input_ids": base}, [{"input_ids": src}], {"sources->base": ([[[ps]] * n], [[[pb]] * n])})
                hits += int((cf.logits[:, -1].gather(1, cands).argmax(1) == lab).sum())
                n_all += n
        out["iia"].append(hits / n_all)
    print(json.dumps(out))


def run(quick: bool = True, pyvene_python: str = DEFAULT_PYVENE) -> list[dict]:
    """The rows (module docstring): seconds per site of each tool and each one's multiple of the floor."""
    from depthscope.hooks import load_model

    torch.set_num_threads(1)
    model = load_model()
    train, test = _data(model)
    rate = peak_rate()
    layers = QUICK_LAYERS if quick else None
    per_site, iia = depthscope_seconds(model, train, test, layers)
    n_sites = 2 * model.n_layers + 1
    floor = {layer: floor_flops(model, train, 2 * layer + 2) / rate for layer in PYVENE_LAYERS[quick]}
    floor_site = sum(floor.values()) / len(floor)
    rows = [
        {
            "figure": f"DAS dim 1, {N_TRAIN} train, 1 epoch: seconds per site (x {n_sites} sites)",
            "depthscope": per_site,
            "baseline": float("nan"),
            "ratio": float("nan"),
            "note": f"{len(iia)} sites timed; floor {floor_site:.2f} s/site: depthscope {per_site / floor_site:.1f}x "
            f"floor; IIA {min(iia):.2f}-{max(iia):.2f}",
        }
    ]
    got = pyvene_seconds(pyvene_python, PYVENE_LAYERS[quick], quick) if Path(pyvene_python).exists() else None
    if got is not None:
        pv_site = sum(got["seconds"]) / len(got["seconds"])
        ds_site, ds_iia = depthscope_seconds(model, train, test, PYVENE_LAYERS[quick])
        rows.append(
            {
                "figure": "DAS dim 1 at the same block outputs: seconds per site, depthscope vs pyvene 0.1.8",
                "depthscope": ds_site,
                "baseline": pv_site,
                "ratio": ds_site / pv_site,
                "goal": 1.0,
                "note": f"floor {floor_site:.2f} s/site; depthscope {ds_site / floor_site:.1f}x, pyvene "
                f"{pv_site / floor_site:.1f}x floor; IIA depthscope {ds_iia}, pyvene {got['iia']}",
            }
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pyvene-python", default=DEFAULT_PYVENE)
    p.add_argument("--as-pyvene", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layers", default="14", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.as_pyvene:
        _pyvene_main([int(x) for x in a.layers.split(",")])
        return
    for row in run(a.quick, a.pyvene_python):
        print(row)


if __name__ == "__main__":
    main()
