"""GPU figures: capture, lens, probe fits and patching on one CUDA card, each against its
baseline in the same run.

==========  ==========================================================================================
section     arms (same inputs, interleaved, synchronised wall-clock, median of the rounds)
==========  ==========================================================================================
gemm        ``torch.mm`` in bf16 and fp32 at 8192^3 and at the model's MLP shape: the rates the
            forwards are read against
capture     bare forward vs ``residual_stream`` (all 2L+1 sites and the logits): 135M in fp32 and bf16,
            360M and 1.1B in bf16; the capture's extra GPU memory over a bare forward's, per byte of
            the result
lens        ``logit_lens`` vs its floor (capture plus a bare unembedding of every site's rows)
probes      per-site softmax probes (subspace solver) on the GPU vs the same fit on this machine's
            CPU (all cores) vs scikit-learn, on the same standardised features of the EWT sample
patching    one IOI pair, all residual sites batched vs one forward per site; 100 IOI pairs, every
            head, vs a hook loop
mainjob     (only when named) ``depthscope run`` with the model and the probe fits on the card, vs
            the same run on all CPU cores: on the default model where it is installed, else on
            the random-init 135M; each task's E_Delta compared between the two
profile     (only when named) torch.profiler's costliest operators of a bare bfloat16 forward,
            the same with capture, and the logit lens: no figures, tables in ``--out``
==========  ==========================================================================================

The models are random-init Llama configs of the SmolLM2-135M and 360M and TinyLlama-1.1B shapes,
built in their dtype on the GPU (no weights travel to the card's machine); the tokenizer is
SmolLM2's (``--model-dir``: a folder with its ``config.json`` and tokenizer). Timing a random-init
model is timing the real one: the work does not depend on the weights' values. The probe fits'
features are the random-init 135M's, so their accuracies say nothing; the fits' times and the
agreement of the three fits' objectives do.

Run: ``python -m benchmarks.bench_gpu --out DIR`` (``--model-dir DIR`` where the default model is
not installed; ``--quick``: fewer rounds and tokens, also on a CPU, to check the script). Prints
each section's rows as it ends, then the whole table, and writes ``gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks._common import Row, format_table
from benchmarks.bench_scale import SHAPES as SCALE_SHAPES
from benchmarks.bench_scale import _arms, matmul_params

NAME = "gpu"
SHAPES = ("135m", "360m", "1b")
#: sections that run only when ``--only`` names them (minutes of device time)
OPT_IN = ("mainjob", "profile")


# ----------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(arms: dict[str, Callable], device: torch.device, rounds: int, warmup: int = 2) -> dict:
    """Seconds per round of each arm: warm-up, then the arms in turn, synchronised around each call."""
    for _ in range(warmup):
        for fn in arms.values():
            fn()
    out: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(rounds):
        for k, fn in arms.items():
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            out[k].append(time.perf_counter() - t)
    return out


def med(x: list[float]) -> float:
    return statistics.median(x)


def paired(a: list[float], b: list[float]) -> float:
    """Median of the per-round ratios a/b."""
    return statistics.median(x / y for x, y in zip(a, b))


def mm_rate(rows: int, inner: int, cols: int, dtype: torch.dtype, device: torch.device, reps: int = 20) -> float:
    """FLOP/s of ``[rows, inner] @ [inner, cols]`` in ``dtype``: the median of ``reps`` timed
    products after three warm-ups, on random data."""
    a = torch.randn(rows, inner, dtype=dtype, device=device)
    b = torch.randn(inner, cols, dtype=dtype, device=device)
    out = torch.empty(rows, cols, dtype=dtype, device=device)
    t = interleaved({"mm": lambda: torch.mm(a, b, out=out)}, device, reps, warmup=3)["mm"]
    return 2 * rows * inner * cols / med(t)


# ----------------------------------------------------------------------------- models
def build(shape: str, model_dir: Path, dtype: torch.dtype, device: torch.device):
    """A random-init Llama of ``shape`` made directly in ``dtype`` on ``device``, as a HookedModel."""
    import transformers as tf

    from depthscope.hooks import load_model

    tok = tf.AutoTokenizer.from_pretrained(model_dir)
    cfg = tf.AutoConfig.from_pretrained(model_dir) if shape == "135m" else tf.LlamaConfig(**SCALE_SHAPES[shape])
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = tf.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(before)
    if cfg.vocab_size < len(tok):
        tok = None  # the 1.1B's 32000 ids: the capture rows use ids, not text
    return load_model(hf, tokenizer=tok)


def random_ids(model, batch: int, tokens: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, model.hf_model.config.vocab_size, (batch, tokens), generator=g).to(device)


# ----------------------------------------------------------------------------- capture
def _capture_arms(model, ids) -> dict:
    """``bare`` (the transformers forward) and ``capture`` (``residual_stream``: every site and the logits)."""
    arms = _arms(model, ids)
    return {"bare": arms["bare"], "capture": arms["depthscope"]}


def _peak_extra(fn: Callable, device: torch.device) -> tuple[int, object]:
    """Peak GPU memory allocated during ``fn()`` above what was allocated before it, and its result."""
    _sync(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - before, out


def capture_rows(shape: str, dtype: torch.dtype, args, device: torch.device) -> list[Row]:
    """Capture vs bare forward (time, share of the GEMM rate, extra memory per result byte)."""
    model = build(shape, args.model_dir, dtype, device)
    batch, tokens = (2, 64) if args.quick else (8, 512)
    ids = random_ids(model, batch, tokens, device)
    t = interleaved(_capture_arms(model, ids), device, args.rounds)
    n_tok, d, name = batch * tokens, model.d_model, f"{shape} {str(dtype).removeprefix('torch.')}"
    rate = mm_rate(n_tok, d, 4 * d, dtype, device)
    flops = 2 * matmul_params(model) * n_tok
    note = f"{batch}x{tokens} tokens, {model.n_sites} sites, {matmul_params(model) / 1e6:.0f}M matmul params"
    rows = [
        Row(
            f"{name}: capture / bare forward",
            f"{med(t['capture']) * 1e3:.1f} ms",
            f"{med(t['bare']) * 1e3:.1f} ms",
            paired(t["capture"], t["bare"]),
            "<= 1.05",
            note,
        ),
        Row(
            f"{name}: forward with capture / GEMM rate at the MLP shape",
            f"{flops / med(t['capture']) / 1e12:.1f} TFLOP/s",
            f"{rate / 1e12:.1f} TFLOP/s (mm {n_tok}x{d}x{4 * d})",
            flops / med(t["capture"]) / rate,
            "",
            note,
        ),
    ]
    if device.type == "cuda":
        arms = _capture_arms(model, ids)
        bare, _ = _peak_extra(arms["bare"], device)
        cap, rs = _peak_extra(arms["capture"], device)
        result = rs.resid.numel() * rs.resid.element_size()
        rows.append(
            Row(
                f"{name}: capture's extra GPU memory / result",
                f"{(cap - bare) / 2**20:.0f} MiB above bare",
                f"{result / 2**20:.0f} MiB result",
                (cap - bare) / result,
                "<= 1.1",
                f"bare forward peak {bare / 2**20:.0f} MiB",
            )
        )
        del rs
        if dtype != torch.float32 and not args.quick:  # host-bound at 8 x 512: does a 4x batch amortise it?
            big = random_ids(model, 4 * batch, tokens, device)
            t = interleaved(_capture_arms(model, big), device, args.rounds)
            rows.append(
                Row(
                    f"{name}: capture / bare forward, {4 * batch}x{tokens} tokens",
                    f"{med(t['capture']) * 1e3:.1f} ms",
                    f"{med(t['bare']) * 1e3:.1f} ms",
                    paired(t["capture"], t["bare"]),
                    "<= 1.05",
                    "a 4x batch: the hooks' host time over more work on the card",
                )
            )
    del model
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


# ----------------------------------------------------------------------------- lens
def sample_text_ids(model, n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` ids of the bundled EWT sample's text (repeated if short)."""
    import re

    from depthscope.probes import sample_data

    text = Path(sample_data()["ewt_train"]).read_text(encoding="utf-8")
    ids = model.tokenizer(" ".join(re.findall(r"^# text = (.+)$", text, re.M)))["input_ids"]
    return torch.tensor((ids * (n_tokens // len(ids) + 1))[:n_tokens])


def lens_rows(model, args, device: torch.device) -> list[Row]:
    """``logit_lens`` over the sample's tokens vs capture plus a bare unembedding of every row."""
    from depthscope.analyses.lens.logit import _token_chunk, logit_lens

    n, window, batch = (64, 32, 2) if args.quick else (4096, 512, 8)
    ids = sample_text_ids(model, n)[None].to(device)
    W = model.arch.unembed.weight
    chunk = 4096
    out = torch.empty(chunk, W.shape[0], device=device, dtype=W.dtype)

    def lens():
        return logit_lens(model, ids, window=window, batch_size=batch)

    cpu_chunk = _token_chunk(None, model.n_sites, W.shape[0], torch.device("cpu"))

    def lens_cpu_chunk():  # the CPU's decode chunk on the card (the default before GPU_BUFFER_MB)
        return logit_lens(model, ids, window=window, batch_size=batch, token_chunk=cpu_chunk)

    def floor():
        rs = model.residual_stream(ids.reshape(-1, window), check_finite=False)
        x = rs.resid.reshape(-1, rs.resid.shape[-1])
        with torch.no_grad():
            for c in range(0, len(x), chunk):
                h = model.unembed.norm(x[c : c + chunk])
                torch.mm(h, W.t(), out=out[: len(h)])

    t = interleaved({"lens": lens, "floor": floor, "cpu_chunk": lens_cpu_chunk}, device, args.rounds)
    gpu_chunk = _token_chunk(None, model.n_sites, W.shape[0], device)
    return [
        Row(
            f"135m fp32: logit lens, GPU decode chunk / CPU decode chunk, {n} tokens",
            f"{med(t['lens']) * 1e3:.0f} ms",
            f"{med(t['cpu_chunk']) * 1e3:.0f} ms",
            paired(t["lens"], t["cpu_chunk"]),
            "",
            f"{gpu_chunk} against {cpu_chunk} positions x {model.n_sites} sites per decode",
        ),
        Row(
            f"135m fp32: logit lens / floor (capture + bare unembedding), {n} tokens",
            f"{med(t['lens']) * 1e3:.0f} ms",
            f"{med(t['floor']) * 1e3:.0f} ms",
            paired(t["lens"], t["floor"]),
            "<= 1.5",
            f"{model.n_sites} sites x {n} tokens, vocab {W.shape[0]}; windows of {window}, {batch} per forward",
        ),
    ]


# ----------------------------------------------------------------------------- probes
def _on(X: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``X [S, N, D]`` on ``device``, feature-major like the resident features (a transposed view)."""
    return X.transpose(1, 2).contiguous().to(device).transpose(1, 2)


def _objectives(probe, X: torch.Tensor, y: np.ndarray, sites) -> np.ndarray:
    from benchmarks.bench_probe_fit import objective_np

    W, b = probe.W.detach().cpu().numpy(), probe.b.detach().cpu().numpy()
    return np.array([objective_np(W[s], b[s].reshape(-1), X[s].numpy(), y) for s in sites])


def probe_rows(model, args, device: torch.device) -> list[Row]:
    """Per-site upos probes on the bundled EWT sample's features: GPU vs all CPU cores vs scikit-learn."""
    from benchmarks.bench_probe_fit import fit_depthscope, fit_sklearn, objective_np, sk_weights, sklearn_arrays
    from depthscope.probes import prepare_task, sample_data

    p = sample_data()
    t0 = time.perf_counter()
    td = prepare_task(model, "upos", p["ewt_train"], p["ewt_test"], progress=False)
    extract = time.perf_counter() - t0
    print(f"  features extracted in {extract:.1f} s", flush=True)
    tr = td.feats["train"]
    X, y, C = tr.resident.float(), np.asarray(td.y["train"])[tr.order], td.n_classes
    S, N, D = X.shape
    Xg = _on(X, device)
    torch.set_num_threads(os.cpu_count() or 1)
    fits = {}

    def arm(name, feats):
        def fn():
            fits[name] = fit_depthscope(feats, y, C, solver="subspace")[0]

        return fn

    t = interleaved({"gpu": arm("gpu", Xg), "cpu": arm("cpu", X)}, device, 2 if not args.quick else 1, warmup=1)
    print(f"  fits: gpu {t['gpu']} s, cpu {t['cpu']} s", flush=True)
    some = np.linspace(0, S - 1, 4 if not args.quick else 2).round().astype(int)
    t1 = time.perf_counter()
    clfs = fit_sklearn(sklearn_arrays(X[torch.from_numpy(some)]), y)
    sk = (time.perf_counter() - t1) / len(some)
    og, oc = _objectives(fits["gpu"], X, y, range(S)), _objectives(fits["cpu"], X, y, range(S))
    osk = np.array([objective_np(*sk_weights(c, D, C), X[s].numpy(), y) for s, c in zip(some, clfs)])
    gap_cpu = float(np.max(np.abs(og - oc) / oc))
    gap_sk = float(np.max((og[some] - osk) / osk))
    note = f"{S} sites x {N} words x {D}, {C} classes; extraction on the model's device {extract:.1f} s"
    gpu_site, cpu_site = med(t["gpu"]) / S, med(t["cpu"]) / S
    return [
        Row(
            "probe fit per site: GPU / this machine's CPU (all cores, same solver)",
            f"{gpu_site * 1e3:.1f} ms",
            f"{cpu_site * 1e3:.1f} ms ({torch.get_num_threads()} threads)",
            cpu_site / gpu_site,
            "",
            note + f"; objectives agree to {gap_cpu:.1e} (relative)",
        ),
        Row(
            "probe fit per site: GPU / scikit-learn (lbfgs, CPU, all cores)",
            f"{gpu_site * 1e3:.1f} ms",
            f"{sk * 1e3:.0f} ms (on {len(some)} sites)",
            sk / gpu_site,
            ">= 10",
            note + f"; GPU objective above sklearn's by at most {gap_sk:.1e} (relative)",
        ),
    ]


# ----------------------------------------------------------------------------- patching
def patching_rows(model, args, device: torch.device) -> list[Row]:
    """One pair over all residual sites, and a dataset of IOI pairs over every head, each against
    its plain loop of forwards."""
    from benchmarks.bench_patching import CLEAN, CORRUPTED, _head_loop, _one_per_site, ioi_pairs
    from depthscope.analyses.circuits.patching.activation import activation_patching

    tok = model.tokenizer
    target, foil = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (" Mary", " John"))
    t = interleaved(
        {
            "batched": lambda: activation_patching(model, CLEAN, CORRUPTED, (target, foil)),
            "loop": lambda: _one_per_site(model, target, foil),
        },
        device,
        args.rounds,
    )
    n_pairs, n_loop = (4, 1) if args.quick else (100, 2)
    pairs = ioi_pairs(tok, n_pairs)
    d = interleaved(
        {
            "dataset": lambda: activation_patching(model, pairs, sites="heads", positions="last"),
            "loop": lambda: _head_loop(model, pairs[:n_loop]),
        },
        device,
        1 if args.quick else 2,
        warmup=1,
    )
    ours, loop = med(d["dataset"]) / n_pairs, med(d["loop"]) / n_loop
    heads = model.n_layers * model.hf_model.config.num_attention_heads
    return [
        Row(
            f"activation patching, {model.n_sites} residual sites of one pair: batched / one forward per site",
            f"{med(t['batched']) * 1e3:.1f} ms",
            f"{med(t['loop']) * 1e3:.1f} ms",
            med(t["loop"]) / med(t["batched"]),
            ">= 3",
            "ratio: speed-up",
        ),
        Row(
            f"patching a dataset: {n_pairs} IOI pairs x {heads} heads (last position) / hook loop per head",
            f"{1 / ours:.1f} pairs/s",
            f"{1 / loop:.2f} pairs/s (loop on {n_loop} pairs)",
            loop / ours,
            "",
            "ratio: speed-up per pair",
        ),
    ]


# ----------------------------------------------------------------------------- the main job, and profiles
def _run_main_job(folder: Path | None, out: Path, device: str, threads: int) -> dict:
    """One ``depthscope run`` on the model ``folder`` (None: the embedded default model) in a fresh
    subprocess with a fresh activation store (so its extraction counts): wall seconds, the run's
    stage seconds and each task's E_Delta."""
    import subprocess
    import sys

    import pandas as pd

    cli = [sys.executable, "-c", "from depthscope.analyses.cli import main; main()"]
    cmd = [*cli, "run", "--out", str(out), "--force", "--threads", str(threads)]
    cmd += ["--device", device, "--probe-device", device] + ([] if folder is None else ["--model", str(folder)])
    env = {**os.environ, "DEPTHSCOPE_CACHE": str(out.parent / f"cache-{out.name}"), "OMP_NUM_THREADS": str(threads)}
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"depthscope run on {device} failed: {proc.stderr[-2000:]}")
    summary = pd.read_csv(out / "probes_summary.csv")
    return {
        "wall": wall,
        "seconds": json.loads((out / "run.json").read_text()).get("seconds", {}),
        "e_delta": dict(zip(summary["task"], summary["expected_layer_delta"])),
    }


def main_job_rows(args, device: torch.device) -> list[Row]:
    """``depthscope run`` end to end (lens, norms, probes, report) with the model and the probe
    fits on this device, and on all CPU cores: on the embedded default model when ``--model-dir``
    was not given (it is installed then), else on the random-init 135M saved as a folder (its
    probe fits are unlike the real model's, so its times are a rough guide). The row's note gives
    the largest difference of a task's E_Delta between the two arms."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="depthscope-gpu-main-job-") as tmp:
        folder, what = None, "the embedded default model"
        if not args.real_model:
            folder, what = Path(tmp) / "model", "random-init 135M"
            model = build("135m", args.model_dir, torch.float32, torch.device("cpu"))
            model.hf_model.save_pretrained(folder)
            model.tokenizer.save_pretrained(folder)
            del model
        here = _run_main_job(folder, Path(tmp) / "on-device", str(device), os.cpu_count() or 1)
        print(f"  main job on {device}: {here['wall']:.0f} s wall; stages {here['seconds']}", flush=True)
        cpu = _run_main_job(folder, Path(tmp) / "on-cpu", "cpu", os.cpu_count() or 1)
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in here["seconds"].items() if k != "total")
    gap = max(abs(here["e_delta"][t] - cpu["e_delta"][t]) for t in here["e_delta"])
    return [
        Row(
            f"main job (depthscope run, {what}, bundled sample) on {device} / on the CPU",
            f"{here['wall']:.0f} s",
            f"{cpu['wall']:.0f} s ({os.cpu_count()} threads)",
            cpu["wall"] / here["wall"],
            "",
            f"ratio: speed-up; each a fresh process and activation store; on {device}: {stages}; "
            f"E_Delta differs by at most {gap:.4f} block",
        )
    ]


def profile_rows(args, device: torch.device) -> list[Row]:
    """torch.profiler tables (the 20 costliest operators) of a bare bfloat16 forward, the same
    forward with capture, and the float32 logit lens, printed and written to ``--out``: where
    the capture's and the lens's extra time goes. No figures."""
    from torch.profiler import ProfilerActivity, profile

    from depthscope.analyses.lens.logit import logit_lens

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    batch, tokens = (2, 64) if args.quick else (8, 512)
    bf = build("135m", args.model_dir, torch.bfloat16, device)
    fns = _capture_arms(bf, random_ids(bf, batch, tokens, device))
    fp = build("135m", args.model_dir, torch.float32, device)
    ids = sample_text_ids(fp, batch * tokens)[None].to(device)
    fns["lens"] = lambda: logit_lens(fp, ids, window=tokens, batch_size=batch)
    for name, fn in fns.items():
        fn()
        _sync(device)
        with profile(activities=acts) as prof:
            fn()
            _sync(device)
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=20)
        print(f"--- profile: {name}\n{table}", flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"profile_{name}.txt").write_text(table)
    return []


# ----------------------------------------------------------------------------- main
def gemm_rows(device: torch.device, quick: bool) -> list[Row]:
    n = 1024 if quick else 8192
    return [
        Row(
            f"GEMM rate {n}^3 {name}",
            f"{mm_rate(n, n, n, dt, device) / 1e12:.1f} TFLOP/s",
            "-",
            float("nan"),
            "",
            "torch.mm on random data, median of 20 after 3 warm-ups",
        )
        for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))
    ]


def machine_info(device: torch.device) -> dict:
    info = {
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "sms": props.multi_processor_count,
        }
    return info


def sections(args, device: torch.device) -> list[tuple[str, Callable[[], list[Row]]]]:
    def on_135m(fn):
        return lambda: fn(build("135m", args.model_dir, torch.float32, device), args, device)

    out = [("gemm", lambda: gemm_rows(device, args.quick))]
    for shape, dt in (
        ("135m", torch.float32),
        ("135m", torch.bfloat16),
        ("360m", torch.bfloat16),
        ("1b", torch.bfloat16),
    ):
        if shape in args.shapes:
            out.append(("capture", lambda s=shape, d=dt: capture_rows(s, d, args, device)))
    out += [("lens", on_135m(lens_rows)), ("patching", on_135m(patching_rows)), ("probes", on_135m(probe_rows))]
    out += [("profile", lambda: profile_rows(args, device)), ("mainjob", lambda: main_job_rows(args, device))]
    return [(k, fn) for k, fn in out if (k in args.only if args.only else k not in OPT_IN)]


def default_model_dir(folder: Path) -> Path:
    """The default model's config and tokenizer written to ``folder`` (no weights): what
    ``--model-dir`` is when not given, on a machine where the default model is installed."""
    from depthscope.hooks import load_model

    model = load_model()
    model.tokenizer.save_pretrained(folder)
    model.hf_model.config.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="a folder with SmolLM2's config.json and tokenizer (default: taken from the installed default model)",
    )
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        choices=["gemm", "capture", "lens", "probes", "patching", *OPT_IN],
        help=f"these sections only (default: all but {', '.join(OPT_IN)}, which run only when named)",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    args.real_model = args.model_dir is None  # the default model is installed: the main job runs on it
    if args.model_dir is None:
        import tempfile

        args.model_dir = default_model_dir(Path(tempfile.mkdtemp(prefix="depthscope-gpu-")))
    rows: list[Row] = []
    for name, fn in sections(args, device):
        t = time.perf_counter()
        try:
            got = fn()
        except Exception as e:  # one section's failure is a row; the others still run
            import traceback

            traceback.print_exc()
            got = [Row(f"{name}: FAILED", f"{type(e).__name__}: {str(e)[:120]}", "-", float("nan"))]
        print(f"[{name}] {time.perf_counter() - t:.1f} s", flush=True)
        print(format_table(got), flush=True)  # each section's rows as they come: a run cut short keeps them
        rows += got
        if device.type == "cuda":
            torch.cuda.empty_cache()
    info = machine_info(device)
    print(json.dumps(info))
    print(format_table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        recs = [
            {
                "figure": r.figure,
                "depthscope": r.depthscope,
                "baseline": r.baseline,
                "ratio": r.ratio,
                "goal": r.goal,
                "met": r.met,
                "note": r.note,
            }
            for r in rows
        ]
        (args.out / "gpu.json").write_text(json.dumps({"machine": info, "rows": recs}, indent=2))


if __name__ == "__main__":
    main()
