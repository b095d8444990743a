"""The Ray engine for sweeps: one Ray task per checkpoint, on a local Ray or an existing cluster.

=============================  ==================================================================
:class:`RayEngine`             ``address`` (None: start a local Ray with ``workers`` CPUs),
                               ``workers``, ``gpus_per_task``, ``max_retries``, ``connect_timeout``
:meth:`RayEngine.run`          run the sweep's per-checkpoint function as Ray tasks; outcomes in
                               checkpoint order
:func:`require_ray`            import ray, or say the install command
:func:`check_resources`        refuse CPUs or GPUs per task that the cluster does not have
:data:`INSTALL_RAY`            the install command
=============================  ==================================================================

Each task is :func:`depthscope.analyses.sweeps.series._run_checkpoint`: it loads the checkpoint, runs
the analysis and writes the checkpoint's tables and marker atomically, exactly as the local
engine does, so resume, failure records and the combined table do not depend on the engine.
A worker that dies mid-task (killed, out of memory) is retried by Ray ``max_retries`` times;
a retry rewrites the same files (atomic replaces, marker last), so no row is lost or doubled,
and a task that still fails is recorded as ``checkpoints/<name>.failed.json``.

Workers import depthscope and run the analysis function, so a cluster given by ``address``
must have depthscope installed (a local Ray gets this process's ``sys.path``), and must see the
checkpoints and the output folder at the same paths (a shared file system); each task runs in
the driver's working folder when it exists on the worker, so relative paths work too.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

from depthscope.common.errors import DepthscopeError, InputError
from depthscope.common.files import atomic_text
from depthscope.common.settings import CPUS, Limit, Settings, check_settings, setting

INSTALL_RAY = "pip install 'depthscope[ray]'  (or: pip install 'ray>=2.40')"
#: the most GPUs one task can reserve: the GPUs one node may have (8 on most, 16 on the largest)
MAX_GPUS = 16
#: the smallest fraction of a GPU a task reserves (finer shares only crowd a GPU with tasks)
MIN_GPU_SHARE = 0.01


def check_gpus(name: str, gpus) -> None:
    """``gpus`` per Ray task: 0 (none), a fraction from :data:`MIN_GPU_SHARE` to 1 (tasks share a
    GPU), or a whole number up to :data:`MAX_GPUS` (Ray refuses fractions above 1, and no node has
    more GPUs); else an InputError naming ``name``."""
    real = isinstance(gpus, (int, float)) and not isinstance(gpus, bool)
    try:
        finite = real and math.isfinite(gpus)
    except OverflowError:
        finite = False
    if not finite or gpus < 0:
        raise InputError(f"{name} must be a finite number >= 0 (0: CPU tasks), got {gpus!r}")
    if 0 < gpus < MIN_GPU_SHARE:
        raise InputError(f"{name} must be 0 or at least {MIN_GPU_SHARE} (a share of one GPU), got {gpus:g}")
    if gpus > 1 and gpus != int(gpus):
        raise InputError(
            f"{name} above 1 must be a whole number of GPUs (Ray shares only fractions of one), got {gpus:g}"
        )
    if gpus > MAX_GPUS:
        raise InputError(f"{name} must be at most {MAX_GPUS} (the GPUs one node may have), got {gpus:g}")


class RayUnavailable(DepthscopeError, RuntimeError):
    """Ray is not installed, or the cluster at ``--address`` cannot be reached."""


def require_ray():
    """The ``ray`` module, or a clear error with the install command."""
    try:
        import ray  # lazy: Ray is optional (the ray extra)
    except ImportError:
        raise RayUnavailable(f"--engine ray needs Ray, which is not installed: run `{INSTALL_RAY}`") from None
    return ray


@dataclass
class RayEngine(Settings):
    """Run a sweep's checkpoints as Ray tasks (see the module docstring)."""

    #: None: a local Ray with ``workers`` CPUs; "auto", "host:port" or "ray://host:port"
    address: str | None = setting(
        None,
        "--address",
        help="Ray cluster to join (host:port, ray://host:port or auto); default: a local Ray.",
    )
    #: local Ray: CPUs (= concurrent tasks); on a cluster, unused
    workers: int = setting(
        2, "--workers", min=1, max=CPUS, help="CPUs of the local Ray (concurrent checkpoints); --engine ray."
    )
    #: GPUs each task reserves (Ray sets CUDA_VISIBLE_DEVICES for it)
    gpus_per_task: float = setting(
        0.0,
        "--gpus-per-task",
        cli_min=0.0,
        check=check_gpus,
        help=f"GPUs each Ray task reserves (0: none, CPU tasks; use with --device cuda): a share of one GPU "
        f"({MIN_GPU_SHARE} .. 1) or a whole number up to {MAX_GPUS}; --engine ray.",
    )
    #: retries of a task whose worker died
    max_retries: int = setting(1, min=0, max=Limit(100, "a task that died 100 times will die again"))
    #: seconds to wait for --address before giving up
    connect_timeout: float = setting(10.0, positive=True, max=Limit(3600.0, "an hour"))

    def __post_init__(self):
        check_settings(self)

    def run(self, pending: Sequence, task: Callable, reference, allow_mixed: bool, *, progress: bool = True):
        """``task(ck, reference=..., allow_mixed=...)`` for each pending checkpoint as a Ray task;
        returns the outcomes (``{checkpoint, status, error, fingerprint}``) in checkpoint order."""
        if not pending:
            return []
        ray = require_ray()
        started = self._connect(ray)
        try:
            check_resources(ray.cluster_resources(), self.gpus_per_task, self.address)
            remote = ray.remote(num_cpus=1, num_gpus=self.gpus_per_task, max_retries=self.max_retries)(_task)
            shared = ray.put(task)  # the analysis, its texts and the loader: sent once, not once per task
            cwd = os.getcwd()  # relative checkpoint, output and data paths mean the same in every task
            refs = {remote.remote(shared, ck, reference, allow_mixed, cwd): ck for ck in pending}
            outcomes = {}
            bar = _bar(progress, len(refs))
            waiting = list(refs)
            while waiting:
                ready, waiting = ray.wait(waiting, num_returns=1)
                ck = refs[ready[0]]
                try:
                    outcomes[ck.name] = ray.get(ready[0])
                except Exception as e:  # the worker died more often than max_retries
                    outcomes[ck.name] = _record_lost(task, ck, e, self.max_retries)
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.close()
            return [outcomes[ck.name] for ck in pending]
        finally:
            if started:
                ray.shutdown()

    def _connect(self, ray) -> bool:
        """Join ``address`` (checked within ``connect_timeout``) or start a local Ray; True when
        this call started Ray (and so shuts it down)."""
        if ray.is_initialized():
            return False
        if self.address is None:
            path = os.pathsep.join(p for p in sys.path if p)
            ray.init(
                address="local",  # a new Ray of our own, even where a cluster runs on this machine
                num_cpus=self.workers,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": path}},
            )
            return True
        if self.address != "auto":
            _check_reachable(self.address, self.connect_timeout)
        _init_within(ray, self.address, self.connect_timeout)
        return True


def check_resources(cluster: dict, gpus_per_task: float, address: str | None = None) -> None:
    """Refuse, before any task is submitted, a request the cluster cannot ever grant: Ray would
    keep such a task pending forever. ``cluster`` is ``ray.cluster_resources()``; each task asks
    for one CPU and ``gpus_per_task`` GPUs."""
    where = f"the Ray cluster at {address}" if address else "the local Ray"
    cpus, gpus = float(cluster.get("CPU", 0.0)), float(cluster.get("GPU", 0.0))
    if cpus < 1:
        raise RayUnavailable(f"{where} has no CPU to run a task on (resources: {cluster})")
    if gpus_per_task > gpus:
        have = "no GPU" if gpus == 0 else f"{gpus:g} GPU(s)"
        raise RayUnavailable(
            f"--gpus-per-task {gpus_per_task:g}: each task asks for {gpus_per_task:g} GPU(s) but {where} has {have}, "
            f"so no task could ever start; use --gpus-per-task 0 (CPU tasks) or a cluster with GPUs (--address)"
        )


def _init_within(ray, address: str, timeout: float) -> None:
    """``ray.init(address=...)`` given at most ``timeout`` seconds: something that accepts TCP but
    is no Ray head (a proxy, another service) would otherwise keep ray.init retrying for a minute.
    On a timeout the attempt is left to fail on its own in a daemon thread."""
    box: dict = {}

    def attempt():
        try:
            ray.init(address=address, log_to_driver=False)
            box["ok"] = True
        except Exception as e:
            box["error"] = e

    t = threading.Thread(target=attempt, name="depthscope-ray-connect", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise RayUnavailable(
            f"no Ray cluster answers at {address}: the port accepts connections but no Ray head replied within "
            f"{timeout:g} s; check the address (`ray status` on the head prints it) or leave out --address"
        )
    if "error" in box:
        e = box["error"]
        raise RayUnavailable(f"cannot join the Ray cluster at {address}: {type(e).__name__}: {e}") from e


def _task(task: Callable, ck, reference, allow_mixed: bool, cwd: str) -> dict:
    """The Ray task: one checkpoint, run in the driver's working folder when this worker sees it
    (a local Ray, or a cluster on a shared file system; else give absolute paths)."""
    if os.path.isdir(cwd):
        os.chdir(cwd)
    return task(ck, reference=reference, allow_mixed=allow_mixed)


def _record_lost(task: Callable, ck, error: Exception, retries: int) -> dict:
    """The failure record of a checkpoint whose task died ``retries + 1`` times."""
    msg = f"{type(error).__name__}: the Ray task died {retries + 1} time(s): {str(error).splitlines()[0][:300]}"
    ck_dir = task.keywords["ck_dir"]
    if not (ck_dir / f"{ck.name}.done.json").is_file():  # an attempt may have finished before the report
        record = {"checkpoint": ck.name, "spec": ck.spec, "error": msg}
        atomic_text(ck_dir / f"{ck.name}.failed.json", json.dumps(record, indent=1))
        return {"checkpoint": ck.name, "status": "failed", "error": msg, "fingerprint": None}
    done = json.loads((ck_dir / f"{ck.name}.done.json").read_text())
    return {"checkpoint": ck.name, "status": "done", "error": None, "fingerprint": done.get("fingerprint")}


def _check_reachable(address: str, timeout: float) -> None:
    """A TCP connection to the address's host and port within ``timeout`` seconds, or a clear error
    (ray.init would otherwise wait on an unreachable cluster for a minute or more)."""
    try:  # urlparse raises on a port that is not a number or is past 65535
        url = urlparse(address if "://" in address else f"ray://{address}")
        host, port = url.hostname, url.port
    except ValueError:
        host = port = None
    if not host or not port:
        raise RayUnavailable(f"--address {address!r}: expected host:port (port 1..65535), ray://host:port or auto")
    t0 = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise RayUnavailable(
            f"no Ray cluster answers at {address} ({type(e).__name__}: {e}; gave up after "
            f"{time.monotonic() - t0:.1f} s of at most {timeout:g} s); start one with `ray start --head` or "
            f"leave out --address to run a local Ray"
        ) from e


def _bar(progress: bool, total: int):
    if not progress:
        return None
    from depthscope.common.progress import progress_bar  # lazy: tqdm, --help must not import it

    return progress_bar(total=total, desc="sweep (ray)", unit="ckpt")
