"""What every command does around its job: claim the output folder and the store, load the model, set
threads (the options are declared in :mod:`depthscope.analyses.commands.options`)."""

from __future__ import annotations

from pathlib import Path

from depthscope.analyses.jobs import base
from depthscope.analyses.jobs.base import prepare_store  # noqa: F401  (the commands' store check)

_CLAIMS: list = []


def prepare_out(out: Path, command: str, identity: dict | None = None, force: bool = False) -> None:
    """Check and claim ``out`` before any compute (:func:`~depthscope.analyses.jobs.base.prepare_output`);
    the claim is released when the command ends (:func:`release_outputs`, called by the CLI)."""
    _CLAIMS.append(base.prepare_output(out, command, identity, force=force))


def release_outputs() -> None:
    """Release the output folders this command claimed (the CLI calls it when a command ends)."""
    while _CLAIMS:
        _CLAIMS.pop().release()


def load(model: str | None, device: str = "cpu", dtype: str = "float32", stream: bool = False):
    """``load_model(model, device=device, dtype=dtype, stream=stream)``: bad names and absent devices are
    clear errors."""
    from depthscope.hooks import load_model  # lazy: it imports torch, --help must not

    return load_model(model, device=device, dtype=dtype, stream=stream)


def load_model(o):
    """The model the options ``o`` name (``o.model`` on ``o.device`` in ``o.dtype``; streamed with ``--stream``)."""
    return load(o.model, o.device, o.dtype, bool(getattr(o, "stream", False)))


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads when given, checked first (:func:`depthscope.common.threads.set_threads`)."""
    if threads is not None:
        from depthscope.common import threads as torch_threads  # lazy: it imports torch, --help must not

        torch_threads.set_threads(threads, "--threads")
