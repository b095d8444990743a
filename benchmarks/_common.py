"""The shared benchmark harness: pinned threads, interleaved rounds, peak memory, one result table.

| piece | what it does |
| --- | --- |
| ``Settings`` | quick or full, thread count, rounds; ``pin()`` fixes torch and BLAS/OpenMP threads |
| ``machine()`` | load average, cpu count, threads, versions: recorded beside every figure |
| ``interleave(arms)`` | warm-up, then arms in turn (A B C A B C ...) over >= 5 rounds; seconds per round |
| ``Timed`` | median, spread (min..max) and the median of paired per-round ratios |
| ``peak_memory(...)`` | peak resident memory of one call, in a fresh subprocess (VmHWM, reset first) |
| ``Row`` | one line of the table: figure, depthscope, baseline, ratio, goal, met? |
| ``print_table`` / ``write_results`` | the one table, and the same rows as CSV and JSON |
| ``ud_sentences`` / ``float32_model`` | the shared inputs: UD English EWT text, the default model in float32 |

Every arm of every benchmark runs under the same ``Settings.pin()``: ``torch.set_num_threads``
plus ``threadpoolctl`` (numpy / scikit-learn BLAS and OpenMP). Precision is float32 everywhere,
passed explicitly (``load_model(dtype=torch.float32)``, ``DEPTHSCOPE_PROBE_DTYPE=float32``).
"""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


def _find_ud() -> Path:
    """$DEPTHSCOPE_UD, else the first shared/data/ud beside or above the checkout."""
    if os.environ.get("DEPTHSCOPE_UD"):
        return Path(os.environ["DEPTHSCOPE_UD"])
    for base in (ROOT, ROOT.parent, ROOT.parent.parent):
        if (base / "shared" / "data" / "ud").is_dir():
            return base / "shared" / "data" / "ud"
    return ROOT.parent / "shared" / "data" / "ud"


UD = _find_ud()
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DEPTHSCOPE_PROBE_DTYPE": "float32",
}
for _k, _v in ENV.items():
    os.environ.setdefault(_k, _v)
os.environ["DEPTHSCOPE_PROBE_DTYPE"] = "float32"  # never the timing race in probes.classifiers


# ----------------------------------------------------------------------------- settings
@dataclass
class Settings:
    quick: bool = False
    threads: int = 1
    rounds: int = 5
    warmup: int = 1

    def __post_init__(self):
        if self.rounds < 5:
            raise ValueError("at least 5 interleaved rounds")

    @property
    def clock(self) -> str:
        """'cpu' (this process's CPU time) with one thread: on a shared machine other processes'
        time slices then do not count; 'wall' with more threads (CPU time would count spin-waits)."""
        return "cpu" if self.threads == 1 else "wall"

    def pin(self) -> None:
        """One thread count for torch and for every BLAS/OpenMP pool numpy and sklearn use."""
        import threadpoolctl
        import torch

        torch.set_num_threads(self.threads)
        global _LIMITS
        _LIMITS = threadpoolctl.threadpool_limits(limits=self.threads)
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[k] = str(self.threads)  # and for the memory subprocesses


_LIMITS = None


def machine(settings: Settings) -> dict:
    import torch

    load = os.getloadavg()
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg_1_5_15": [round(x, 2) for x in load],
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "rounds": settings.rounds,
        "clock": settings.clock,
        "quick": settings.quick,
        "dtype": "float32",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_name(),
    }


def _cpu_name() -> str:
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        return m.group(1).strip() if m else platform.processor()
    except OSError:
        return platform.processor()


def machine_line(info: dict) -> str:
    la = info["load_avg_1_5_15"]
    return (
        f"{info['cpu']}; {info['cpu_count']} cpus, load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}; "
        f"{info['threads']} thread(s) per arm; torch {info['torch']}; float32; "
        f"{info['rounds']} interleaved rounds after warm-up; times are {info['clock']} seconds"
    )


# ----------------------------------------------------------------------------- timing
@dataclass
class Timed:
    """Seconds per round of one arm."""

    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> str:
        return f"{min(self.seconds):.3g}..{max(self.seconds):.3g} s"

    def ratio_to(self, other: Timed) -> float:
        """Median of the paired per-round ratios (round k of self / round k of other)."""
        return statistics.median(a / b for a, b in zip(self.seconds, other.seconds))


def interleave(arms: dict[str, Callable[[], object]], settings: Settings) -> dict[str, Timed]:
    """Warm up every arm, then run them in turn for ``settings.rounds`` rounds (``settings.clock``)."""
    clock = time.process_time if settings.clock == "cpu" else time.perf_counter
    for _ in range(settings.warmup):
        for fn in arms.values():
            fn()
    out: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(settings.rounds):
        for k, fn in arms.items():
            t = clock()
            fn()
            out[k].append(clock() - t)
    return {k: Timed(v) for k, v in out.items()}


def timing_note(arms: dict[str, Timed]) -> str:
    return "; ".join(f"{k} median {v.median:.3g} s ({v.spread})" for k, v in arms.items())


# ----------------------------------------------------------------------------- memory
def _status_kb(key: str) -> int:
    m = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(m.group(1))


def measure_peak(fn: Callable[[], object]) -> dict:
    """Peak resident memory of ``fn()`` above the resident memory before it, in bytes.

    The kernel's high-water mark (VmHWM) is reset first (``/proc/self/clear_refs`` = 5), so it
    sees every allocation torch, numpy and the allocator made, which tracemalloc does not."""
    import gc

    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    before = _status_kb("VmRSS")
    out = fn()
    peak = _status_kb("VmHWM")
    return {
        "before": before * 1024,
        "peak": peak * 1024,
        "extra": (peak - before) * 1024,
        "hwm_reset": reset,
        "result": out,
    }


#: glibc's mmap threshold fixed at its default (128 KiB), which turns its dynamic threshold off:
#: a freed large temporary goes back to the OS instead of staying in the heap, so a peak counts
#: live memory only (with the dynamic threshold, whether a block was retained varies run to run)
LIVE_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def peak_memory(module: str, func: str, threads: int, env: dict | None = None, **kwargs) -> dict:
    """Run ``benchmarks.<module>.<func>(**kwargs)`` in a fresh subprocess (``env``: extra
    environment, e.g. :data:`LIVE_MEMORY_ENV`); it returns a dict with ``extra`` (peak bytes
    above the start of the measured call) and anything else it records."""
    cmd = [sys.executable, "-m", "benchmarks._common", module, func, json.dumps({"threads": threads, **kwargs})]
    env = {**os.environ, **ENV, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"memory subprocess {module}.{func} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child() -> None:
    module, func, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    Settings(threads=kw.pop("threads")).pin()
    mod = importlib.import_module(f"benchmarks.{module}")
    print(json.dumps(getattr(mod, func)(**kw)))


def mb(x: float) -> float:
    return x / 2**20


# ----------------------------------------------------------------------------- table
@dataclass
class Row:
    """One figure. ``ratio`` is depthscope / baseline unless the figure says otherwise;
    ``goal`` is a comparison on the ratio ('<= 1.05', '>= 10') or '' (reported only)."""

    figure: str
    depthscope: str
    baseline: str
    ratio: float
    goal: str = ""
    note: str = ""
    bench: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def met(self) -> bool | None:
        if not self.goal or self.ratio is None or math.isnan(self.ratio):
            return None
        op, value = self.goal.split()
        return self.ratio <= float(value) if op == "<=" else self.ratio >= float(value)

    def cells(self) -> list[str]:
        met = {True: "yes", False: "NO", None: "-"}[self.met]
        ratio = "n/a" if self.ratio is None or math.isnan(self.ratio) else f"{self.ratio:.3g}"
        return [self.figure, self.depthscope, self.baseline, ratio, self.goal or "(reported)", met]


HEADER = ["figure", "depthscope", "baseline", "ratio", "goal", "met?"]


def failed_row(bench: str, err: BaseException) -> Row:
    return Row(f"{bench}: FAILED", f"{type(err).__name__}: {str(err)[:80]}", "-", float("nan"), bench=bench)


def format_table(rows: list[Row]) -> str:
    cells = [HEADER] + [r.cells() for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    line = lambda c: " | ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip()  # noqa: E731
    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(c) for c in cells[1:]])


def write_results(rows: list[Row], info: dict, folder: Path = RESULTS) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    records = [
        {
            **dict(zip(HEADER, r.cells())),
            "ratio_value": r.ratio,
            "note": r.note,
            "bench": r.bench,
            **{f"x_{k}": v for k, v in r.extra.items()},
        }
        for r in rows
    ]
    paths = {"json": folder / f"bench-{stamp}.json", "csv": folder / f"bench-{stamp}.csv"}
    paths["json"].write_text(json.dumps({"machine": info, "rows": records}, indent=2, default=str))
    keys = list(dict.fromkeys(k for rec in records for k in rec))
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + ["machine"])
        w.writeheader()
        for rec in records:
            w.writerow({**rec, "machine": machine_line(info)})
    for kind, p in paths.items():
        (folder / f"latest.{kind}").write_text(p.read_text())
    return paths


# ----------------------------------------------------------------------------- inputs
def ud_sentences(name: str = "en_ewt-ud-dev.conllu", limit: int | None = None) -> list[str]:
    """``# text = `` lines of a UD file (``$DEPTHSCOPE_UD`` or shared/data/ud beside the checkout)."""
    path = UD / name
    if not path.is_file():
        raise FileNotFoundError(f"needs UD English EWT ({name}) in {UD}: set DEPTHSCOPE_UD to its folder")
    out = [m.group(1).strip() for m in re.finditer(r"^# text = (.+)$", path.read_text(encoding="utf-8"), re.M)]
    return out[:limit] if limit else out


def float32_model():
    """The default model, float32 (explicit: no arm picks its precision)."""
    import torch

    from depthscope.hooks import load_model

    return load_model(dtype=torch.float32)


def text_ids(model, n_tokens: int):
    """The first ``n_tokens`` token ids of the EWT dev text joined, as a LongTensor."""
    import torch

    ids = model.tokenizer(" ".join(ud_sentences(limit=2000)))["input_ids"]
    if len(ids) < n_tokens:
        ids = ids * (n_tokens // len(ids) + 1)
    return torch.tensor(ids[:n_tokens])


def documents(model, n_tokens: int, per_doc: int = 5) -> list[str]:
    """Consecutive EWT dev sentences grouped into documents, until about ``n_tokens`` tokens."""
    sents, docs, total = ud_sentences(), [], 0
    for i in range(0, len(sents), per_doc):
        d = " ".join(sents[i : i + per_doc])
        docs.append(d)
        total += len(model.tokenizer(d)["input_ids"])
        if total >= n_tokens:
            break
    return docs


if __name__ == "__main__":
    _child()
