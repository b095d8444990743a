"""Checkpoint sweeps: one analysis over a series of checkpoints, one combined tidy table.

>>> from depthscope.analyses.sweeps.series import sweep, discover_checkpoints
>>> cks = discover_checkpoints(checkpoint_dir="runs/tiny")      # step100/, checkpoint-200/, ...
>>> result = sweep(cks, "lens", "out/sweep", texts=["Some text."])
>>> result.tables["by_site"]      # checkpoint, step, site, label, layer, sublayer, depth, metrics...

Layout of the output folder::

    sweep.json                          what was asked (analysis, options, data digest)
    checkpoints/<name>.<table>.parquet  each checkpoint's tables, written atomically when it finishes
    checkpoints/<name>.done.json        its marker, written last (seconds, fingerprint, weight digest)
    checkpoints/<name>.failed.json      a checkpoint that failed, with its error (retried on re-run)
    sweep_<table>.parquet / .csv        the combined tables (checkpoint and step columns first,
                                        duplicate_of: an earlier checkpoint with identical weights)

Engines: ``engine=None`` runs the checkpoints in this process; ``RayEngine(workers=N)``
(:mod:`depthscope.analyses.sweeps.ray_engine`) runs one Ray task per checkpoint, on a local Ray or a
cluster; both write the same files, so a sweep can be resumed with either.

A re-run with the same request skips checkpoints whose tables exist, so an interrupted sweep
resumes without losing or duplicating rows; an output folder holding another request is refused.
A checkpoint whose architecture or tokenizer differs from the first one is refused (recorded as
failed) unless ``allow_mixed=True``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from depthscope.analyses.lens.logit import logit_lens
from depthscope.analyses.norms import contribution_norms
from depthscope.analyses.tables import site_first, write_table
from depthscope.common.digest import ALGORITHM
from depthscope.common.errors import DepthscopeError
from depthscope.common.files import atomic_text, atomic_write, json_text
from depthscope.common.progress import track
from depthscope.hooks import load_model
from depthscope.hooks.stream_identity import ALGORITHM as STREAMED
from depthscope.hooks.stream_identity import store_digest
from depthscope.probes import run_probes

_STEP_PATTERNS = [
    re.compile(r"(?:^|[-_/])(?:global[-_]?)?step[-_]?(\d+)", re.I),
    re.compile(r"checkpoint[-_]?(\d+)", re.I),
    re.compile(r"(?:^|[-_])(\d+)$"),
    re.compile(r"(\d+)"),
]


class SweepError(DepthscopeError):
    pass


class OutputConflict(SweepError):
    """The output folder holds the results of a different request."""


@dataclass(frozen=True)
class Checkpoint:
    name: str
    spec: str
    step: int | None


def parse_step(name: str) -> int | None:
    """The training step in a checkpoint name (``step100``, ``checkpoint-200``, ``model_300``)."""
    stem = Path(name).name
    if stem.endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    for pat in _STEP_PATTERNS:
        m = pat.search(stem)
        if m:
            return int(m.group(1))
    return None


def _is_checkpoint(p: Path) -> bool:
    return (p.is_dir() and (p / "config.json").is_file()) or (p.is_file() and p.suffix == ".gguf")


def discover_checkpoints(
    paths: Sequence[str | Path] = (), checkpoint_dir: str | Path | None = None
) -> list[Checkpoint]:
    """Checkpoints from explicit specs/paths (kept in the given order) and/or a folder of
    sub-folders (``step100``, ``checkpoint-200``, ...) or ``.gguf`` files, ordered by step."""
    out: list[Checkpoint] = []
    for p in paths:
        s = str(p)
        out.append(Checkpoint(name=_safe_name(Path(s).name or s), spec=s, step=parse_step(s)))
    if checkpoint_dir is not None:
        d = Path(checkpoint_dir)
        if not d.is_dir():
            raise SweepError(f"--checkpoint-dir {d} is not a folder")
        found = [p for p in d.iterdir() if _is_checkpoint(p)]
        if not found:
            raise SweepError(f"{d} holds no checkpoints (sub-folders with config.json, or .gguf files)")
        found.sort(key=lambda p: (parse_step(p.name) is None, parse_step(p.name) or 0, p.name))
        out += [Checkpoint(name=_safe_name(p.name), spec=str(p), step=parse_step(p.name)) for p in found]
    if not out:
        raise SweepError("no checkpoints given: pass paths/specs or a checkpoint folder")
    names = [c.name for c in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:  # same folder names under different parents: disambiguate with a digest of the spec
        out = [
            Checkpoint(f"{c.name}-{hashlib.sha1(c.spec.encode()).hexdigest()[:6]}", c.spec, c.step)
            if c.name in dup
            else c
            for c in out
        ]
    return out


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "checkpoint"


# ---------------------------------------------------------------------------- analyses
AnalysisFn = Callable[..., dict[str, pd.DataFrame]]


def _lens(model, *, texts, **kw) -> dict[str, pd.DataFrame]:
    return {"by_site": logit_lens(model, texts, **kw)}


def _norms(model, *, texts, **kw) -> dict[str, pd.DataFrame]:
    return {"by_site": contribution_norms(model, texts, **kw)}


def _probe(model, *, tasks, train, test, dev=None, **kw) -> dict[str, pd.DataFrame]:
    """``kw``: ``config`` / ``extraction`` / ``data`` objects and loose settings, read by
    ``run_probes`` (the configuration objects' defaults, as everywhere)."""
    res = run_probes(model, tasks, train, test, dev, progress=False, **kw)
    return {"by_site": res.by_site, "summary": res.summary}


ANALYSES: dict[str, AnalysisFn] = {"lens": _lens, "norms": _norms, "probe": _probe}


@dataclass
class SweepResult:
    tables: dict[str, pd.DataFrame]
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    out_dir: Path | None = None

    @property
    def ok(self) -> bool:
        return not self.failed


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _describe_inputs(kwargs: dict) -> dict:
    """A JSON-able description of the analysis options; file inputs are digested by content."""
    desc = {}
    for k, v in sorted(kwargs.items()):
        if isinstance(v, (str, Path)) and Path(v).is_file():
            desc[k] = {"file": str(v), "sha256": hashlib.sha256(Path(v).read_bytes()).hexdigest()[:16]}
        elif isinstance(v, (list, tuple)) and v and all(isinstance(t, str) for t in v) and k == "texts":
            desc[k] = {"n_texts": len(v), "sha256": _digest(list(v))}
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):  # ProbeConfig and friends: their fields
            desc[k] = json.loads(json.dumps(dataclasses.asdict(v), default=str))
        else:
            desc[k] = v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else repr(v)
    return desc


def sweep(
    checkpoints: Sequence[Checkpoint | str | Path],
    analysis: str | AnalysisFn,
    out_dir: str | Path,
    *,
    allow_mixed: bool = False,
    overwrite: bool = False,
    load: Callable | None = None,
    progress: bool = True,
    engine=None,
    **analysis_kwargs,
) -> SweepResult:
    """Run ``analysis`` ("lens", "norms", "probe", or a function ``f(model, **kw) -> {name: df}``)
    on each checkpoint, writing each checkpoint's tables atomically as it finishes, and return
    the combined tables with ``checkpoint``, ``step`` and ``duplicate_of`` columns. Failures are
    recorded and the sweep goes on (``result.failed``).

    ``engine``: None or ``"local"`` runs the checkpoints one after another in this process; a
    :class:`~depthscope.analyses.sweeps.ray_engine.RayEngine` runs one Ray task per checkpoint (each
    task writes its own result files, so resume, failure records and the table are the same).
    ``load``: the loader (default :func:`~depthscope.hooks.load_model`; a ``functools.partial``
    of it with ``device``/``dtype``: its keywords become part of the request)."""
    load = load or load_model
    cks = _checkpoints(checkpoints)
    fn = ANALYSES.get(analysis) if isinstance(analysis, str) else analysis
    if fn is None:
        raise SweepError(f"unknown analysis {analysis!r}; choose one of {sorted(ANALYSES)}")
    if engine not in (None, "local") and not hasattr(engine, "run"):
        raise SweepError(f"unknown sweep engine {engine!r}; use 'local' or a RayEngine")
    out = Path(out_dir)
    state = _SweepState.open(out, _request(analysis, analysis_kwargs, load), overwrite)
    result = SweepResult(tables={}, out_dir=out)
    pending = []
    for ck in cks:
        if state.done_marker(ck).is_file():
            result.skipped.append(ck.name)
        else:
            pending.append(ck)
    task = functools.partial(_run_checkpoint, fn=fn, ck_dir=state.ck_dir, load=load, kwargs=analysis_kwargs)
    if engine in (None, "local"):
        for ck in _progress(pending, progress, len(cks), len(result.skipped)):
            outcome = task(ck, reference=state.reference, allow_mixed=allow_mixed)
            if state.reference is None and outcome.get("fingerprint") is not None:
                state.set_reference(ck.name, outcome["fingerprint"])
            _tally(result, outcome)
    else:
        for outcome in engine.run(pending, task, state.reference, allow_mixed, progress=progress):
            _tally(result, outcome)
        state.reconcile(cks, result, allow_mixed)
    result.tables = combine(out, [c.name for c in cks])
    for tname, df in result.tables.items():
        write_table(df, out, f"sweep_{tname}")
    return result


def _checkpoints(checkpoints: Sequence[Checkpoint | str | Path]) -> list[Checkpoint]:
    """Each checkpoint as a :class:`Checkpoint` (a path or spec named after its last part); none is an error."""
    cks = [
        c if isinstance(c, Checkpoint) else Checkpoint(_safe_name(Path(str(c)).name), str(c), parse_step(str(c)))
        for c in checkpoints
    ]
    if not cks:
        raise SweepError("no checkpoints to sweep")
    return cks


def _request(analysis: str | AnalysisFn, analysis_kwargs: dict, load: Callable) -> dict:
    """What a sweep folder records of its request: the analysis, its options (files by digest)
    and the loader's keywords (device, dtype: they change the numbers)."""
    request = {
        "analysis": analysis if isinstance(analysis, str) else getattr(analysis, "__name__", "custom"),
        "options": _describe_inputs(analysis_kwargs),
    }
    if isinstance(load, functools.partial) and load.keywords:
        request["load"] = _describe_inputs(load.keywords)
    return request


def _tally(result: SweepResult, outcome: dict) -> None:
    if outcome["status"] == "done":
        result.done.append(outcome["checkpoint"])
    else:
        result.failed[outcome["checkpoint"]] = outcome["error"]


def _progress(items, progress: bool, total: int, initial: int):
    return track(items, desc="sweep", unit="ckpt", enabled=progress, total=total - initial)


@dataclass
class _SweepState:
    """The output folder of one request: its manifest (the request and the reference
    checkpoint's fingerprint) and the per-checkpoint markers."""

    out: Path
    request: dict
    reference: dict | None

    @property
    def ck_dir(self) -> Path:
        return self.out / "checkpoints"

    def done_marker(self, ck: Checkpoint) -> Path:
        return self.ck_dir / f"{ck.name}.done.json"

    @classmethod
    def open(cls, out: Path, request: dict, overwrite: bool) -> _SweepState:
        """The folder's state; another request's folder is refused (or cleared with ``overwrite``)."""
        manifest = out / "sweep.json"
        reference = None
        if manifest.is_file():
            old = json.loads(manifest.read_text())
            if old.get("request") != request:
                if not overwrite:
                    raise OutputConflict(
                        f"{out} holds the results of another sweep ({old.get('request', {}).get('analysis')} with "
                        f"other options); choose another --out or pass --overwrite"
                    )
                for p in (out / "checkpoints").glob("*"):
                    p.unlink()
                old = {}
            reference = old.get("reference")
        elif out.exists() and any(not p.name.startswith(".depthscope") for p in out.iterdir()) and not overwrite:
            raise OutputConflict(f"{out} is not empty and holds no sweep.json; choose an empty or new --out")
        state = cls(out, request, reference)
        state.ck_dir.mkdir(parents=True, exist_ok=True)
        state.write()
        return state

    def write(self) -> None:
        text = json.dumps({"request": self.request, "reference": self.reference}, indent=1)
        atomic_text(self.out / "sweep.json", text)

    def set_reference(self, name: str, fingerprint: dict) -> None:
        self.reference = {"checkpoint": name, "fingerprint": fingerprint}
        self.write()

    def reconcile(self, cks: Sequence[Checkpoint], result: SweepResult, allow_mixed: bool) -> None:
        """After checkpoints ran in parallel (without a reference yet): the reference is the first
        checkpoint, in order, that loaded; a finished checkpoint of another architecture or
        tokenizer is turned into a failure record, as the local engine would have recorded it."""
        records = {}
        for ck in cks:
            for kind in ("done", "failed"):
                p = self.ck_dir / f"{ck.name}.{kind}.json"
                if p.is_file():
                    records[ck.name] = (kind, json.loads(p.read_text()))
                    break
        if self.reference is None:
            first = next((n for n in (c.name for c in cks) if records.get(n, ("", {}))[1].get("fingerprint")), None)
            if first is None:
                return
            self.set_reference(first, records[first][1]["fingerprint"])
        if allow_mixed:
            return
        for ck in cks:
            kind, rec = records.get(ck.name, ("", {}))
            fp = rec.get("fingerprint")
            if kind != "done" or fp is None or fp == self.reference["fingerprint"]:
                continue
            error = _mixed_error(ck.name, fp, self.reference)
            failure = {"checkpoint": ck.name, "spec": ck.spec, "error": error, "fingerprint": fp}
            atomic_text(self.ck_dir / f"{ck.name}.failed.json", json.dumps(failure, indent=1))
            self.done_marker(ck).unlink()  # the tables go after the marker: never a marker without tables
            for t in rec.get("tables", []):
                (self.ck_dir / f"{ck.name}.{t}.parquet").unlink(missing_ok=True)
            for lst in (result.done, result.skipped):
                if ck.name in lst:
                    lst.remove(ck.name)
            result.failed[ck.name] = error


def _mixed_error(name: str, fp: dict, reference: dict) -> str:
    diff = {k: (reference["fingerprint"].get(k), v) for k, v in fp.items() if reference["fingerprint"].get(k) != v}
    return (
        f"SweepError: mixed series: {name} differs from {reference['checkpoint']} in {diff}; pass allow_mixed=True "
        f"(--allow-mixed) to compare them anyway"
    )


def _run_checkpoint(
    ck: Checkpoint, *, fn: AnalysisFn, ck_dir: Path, load: Callable, kwargs: dict, reference, allow_mixed: bool
) -> dict:
    """Load one checkpoint, run the analysis and write its tables, then its ``done`` marker (or
    its ``failed`` record); returns ``{checkpoint, status, error, fingerprint}``. The unit of
    work of every engine: it runs in this process or in a Ray worker, and its files are written
    atomically, so a retried task replaces, never duplicates, a half-finished attempt."""
    t0 = time.time()
    fp = None
    try:
        model = load(ck.spec)
        fp = model.fingerprint()
        if reference is not None and fp != reference["fingerprint"] and not allow_mixed:
            raise SweepError(_mixed_error(ck.name, fp, reference).removeprefix("SweepError: "))
        # a streamed checkpoint: its files' identity, no second read of its blocks (hooks/stream_identity.py)
        digest, algorithm = store_digest(model), STREAMED if getattr(model, "streamer", None) is not None else ALGORITHM
        tables = fn(model, **kwargs)
        del model
    except KeyboardInterrupt:
        raise
    except Exception as e:  # recorded, the sweep goes on
        msg = f"{type(e).__name__}: {e}"
        record = {"checkpoint": ck.name, "spec": ck.spec, "error": msg, "traceback": traceback.format_exc()}
        if fp is not None:
            record["fingerprint"] = fp
        atomic_text(ck_dir / f"{ck.name}.failed.json", json.dumps(record, indent=1))
        return {"checkpoint": ck.name, "status": "failed", "error": msg, "fingerprint": fp}
    for tname, df in tables.items():
        df = df.copy()
        df.insert(0, "step", ck.step if ck.step is not None else pd.NA)
        df.insert(0, "checkpoint", ck.name)
        atomic_write(ck_dir / f"{ck.name}.{tname}.parquet", lambda t, df=df: df.to_parquet(t, index=False))
    # the marker is written last: a checkpoint counts as finished only once all its tables are
    done = {
        "checkpoint": ck.name,
        "spec": ck.spec,
        "step": ck.step,
        "tables": sorted(tables),
        "seconds": round(time.time() - t0, 2),
        "fingerprint": fp,
        "digest": digest,
        "digest_algorithm": algorithm,
    }
    atomic_text(ck_dir / f"{ck.name}.done.json", json_text(done, indent=1))
    (ck_dir / f"{ck.name}.failed.json").unlink(missing_ok=True)
    return {"checkpoint": ck.name, "status": "done", "error": None, "fingerprint": fp}


def combine(out_dir: str | Path, order: Sequence[str] | None = None) -> dict[str, pd.DataFrame]:
    """The combined tables of a sweep folder (finished checkpoints only), ordered by step, with a
    ``duplicate_of`` column: the earlier checkpoint whose weights have the same digest
    (:func:`~depthscope.common.digest.model_digest`, of every weight), else None; streamed
    checkpoints are recorded by their files' identity
    (:func:`~depthscope.hooks.stream_identity.store_digest`, no second read of the weights), so
    they are duplicates when they are the same files (not copies of the same weights). A marker whose
    digest is of another algorithm (an older depthscope's sample of the weights) proves nothing:
    its checkpoint is nobody's duplicate and has none."""
    ck_dir = Path(out_dir) / "checkpoints"
    records = [json.loads(p.read_text()) for p in ck_dir.glob("*.done.json")]
    finished = {r["checkpoint"]: r for r in records}
    names = [n for n in (order or sorted(finished)) if n in finished]
    duplicate_of = duplicates({n: _full_digest(finished[n]) for n in names})
    tables: dict[str, list[pd.DataFrame]] = {}
    for n in names:
        for tname in finished[n]["tables"]:
            part = pd.read_parquet(ck_dir / f"{n}.{tname}.parquet")
            part["duplicate_of"] = pd.Series([duplicate_of[n]] * len(part), dtype="object")
            tables.setdefault(tname, []).append(part)
    combined = {}
    for tname, parts in tables.items():
        df = pd.concat(parts, ignore_index=True)
        df["step"] = pd.to_numeric(df["step"], errors="coerce")
        combined[tname] = site_first(df, ("checkpoint", "step"))
    return combined


def _full_digest(done: dict) -> str | None:
    """The weight digest a ``done`` marker records, when it is of this depthscope's algorithms: every
    weight's, or a streamed checkpoint's files' (tagged, so the two never compare equal)."""
    if done.get("digest_algorithm") == STREAMED:
        return f"{STREAMED}:{done.get('digest')}"
    return done.get("digest") if done.get("digest_algorithm") == ALGORITHM else None


def duplicates(digests: dict[str, str | None]) -> dict[str, str | None]:
    """For each name (in order), the first earlier name with the same weight digest, else None
    (published series have shipped identical checkpoints under different steps)."""
    first: dict[str, str] = {}
    out: dict[str, str | None] = {}
    for name, d in digests.items():
        out[name] = first.get(d) if d is not None else None
        if d is not None:
            first.setdefault(d, name)
    return out
