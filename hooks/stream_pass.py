"""Streamed passes: every batch of a text through block ``l`` before any goes to block ``l + 1``.

>>> for rs in layer_major(model, batches, lambda b: model.residual_stream(b.ids, mask=b.mask)):
...     use(rs)   # in the batches' order; a streamed model reads each block once per pass

==========================  ===================================================================
:func:`layer_major`         ``fn(item)`` of every item, in order. On a streamed model the items
                            are grouped into passes (the caller's estimate of what each holds,
                            against :data:`PASS_BYTES`) and a pass runs its items' ``fn`` side
                            by side, block by block: one read of the block weights per pass,
                            not per batch; a progress bar counts the pass's blocks
:data:`PASS_BYTES`          the activations one pass may hold (2 GiB): a longer text takes
                            several passes, each reading the weights once
:data:`SPILL_BYTES`         the streams waiting between blocks kept in memory (256 MiB); past it,
                            a waiting stream goes to a temporary file until its turn
:func:`attention_free`      whether hook points allow a pass (the attention points switch the
                            model's attention function for one call: they run batch by batch)
:func:`isolated`            a hook function that fires only in the forward of the pass item
                            that registered it (the engine wraps every hook with it)
==========================  ===================================================================

How it stays exact. Each item's ``fn`` runs as it would alone (its forwards, its hooks and engine,
its code between the blocks) in a worker thread of its own; the threads take turns, one running
at a time, so every product is computed by the same kernels on the same CPU threads. When a
worker's forward reaches a streamed block it waits there; once every worker waits (or is done),
the block they wait at is put in place (read once: :class:`~depthscope.hooks.streaming.BlockStreamer`
reads and converts the next block in the background meanwhile) and each worker in turn runs it
and goes on to its next block. The results are those of the items run one after the other, bit
for bit (``tests/test_stream_pass.py``). A forward's hooks registered inside a worker fire only
in that worker's forward; hooks registered outside (``model.hooks``) fire in every item's. The
model's block list is each worker's own too: a worker's arrangement of it
(:func:`~depthscope.hooks.block_start.from_block`, :func:`~depthscope.hooks.block_order.block_order`)
is put back in place at each of its turns, so items may start at other blocks (``causal``'s erased
forwards start at their site's block); the block put in place next is the lowest any worker waits
at, so forwards that run the blocks in increasing order read each block once per pass.

Memory: the largest block twice (in place, and the next one read ahead), the resident tensors,
and every item's activations (bounded by :data:`PASS_BYTES` through the caller's estimate), of
which the streams waiting between blocks past :data:`SPILL_BYTES` are on disk.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

__all__ = ["layer_major", "attention_free", "isolated", "PASS_BYTES", "SPILL_BYTES"]

#: the activations one streamed pass may hold, by the caller's estimate per item
PASS_BYTES = 2 << 30
#: the streams waiting between blocks held in memory; past it they wait in a temporary file
SPILL_BYTES = 256 << 20

_LOCAL = threading.local()


def worker():
    """``(pass, item index)`` of the pass worker running this code, or None."""
    return getattr(_LOCAL, "worker", None)


def isolated(fn: Callable) -> Callable:
    """``fn`` as registered now: inside a pass worker, a hook that does nothing in the other
    workers' forwards; elsewhere ``fn`` itself."""
    me = worker()
    if me is None:
        return fn

    def hook(*args, **kwargs):
        return fn(*args, **kwargs) if worker() is me else None

    return hook


def attention_free(points) -> bool:
    """True when no point is one of the attention function's (``rot_q``, ``rot_k``, ``scores``,
    ``pattern``): those points switch the model's attention for one call, so they run batch by batch."""
    from depthscope.hooks.attention import ATTENTION_KINDS

    return not any(getattr(p, "kind", None) in ATTENTION_KINDS for p in points)


def layer_major(
    model,
    items: Iterable,
    fn: Callable,
    *,
    held: Callable | None = None,
    enabled: bool = True,
    progress: bool = False,
) -> Iterator:
    """``fn(item)`` for every item of ``items``, yielded in order. On a streamed model (and
    ``enabled``), consecutive items whose ``held(item)`` bytes add up to at most
    :data:`PASS_BYTES` form one pass (at least one item), run block by block (module docstring);
    ``progress``: a bar over each pass's blocks. Elsewhere: one item after the other."""
    streamer = getattr(model, "streamer", None)
    if streamer is None or not enabled:
        for item in items:
            yield fn(item)
        return
    group, used, k = [], 0, 0
    for item in items:
        size = held(item) if held is not None else 0
        if group and used + size > PASS_BYTES:
            k += 1
            yield from _Pass(streamer, model, progress, k).run(group, fn)
            group, used = [], 0
        group.append(item)
        used += size
    if group:
        yield from _Pass(streamer, model, progress, k + 1).run(group, fn)


class _Aborted(Exception):
    """A worker stopped because the pass is abandoned (another part failed, or an interrupt)."""


class _Pass:
    """One pass: workers that take turns, block by block (see the module docstring)."""

    def __init__(self, streamer, model, progress: bool, number: int):
        from depthscope.common.progress import progress_bar

        self.streamer = streamer
        self.blocks, self.config = model.arch.blocks, model.hf_model.config
        self.base = self._view()  # the block list outside the pass; each worker starts from it
        self.views: dict[int, tuple] = {}  # worker -> its block list while it waits (from_block, block_order)
        self.cv = threading.Condition()
        self.state: list = []  # per worker: "new", "run", "done", or the block it waits at
        self.turn: int | None = None
        self.loaded: int | None = None
        self.failure: BaseException | None = None
        self.abort = False
        self.held = 0  # bytes of waiting streams in memory
        self.spill_dir: tempfile.TemporaryDirectory | None = None
        self.next_of: dict[int, int | None] = {}  # block -> the block the forwards run after it
        self.bar = progress_bar(len(self.blocks), desc=f"streamed pass {number}", unit="block", enabled=progress)

    def run(self, items: list, fn: Callable) -> list:
        n = len(items)
        self.state = ["new"] * n
        results, errors = [None] * n, [None] * n
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def work(i: int) -> None:
            _LOCAL.worker = (self, i)
            try:
                with self.cv:
                    while self.turn != i and not self.abort:
                        self.cv.wait()
                    if self.abort:
                        raise _Aborted
                    self._show(self.base)
                mode = torch.inference_mode() if inference else contextlib.nullcontext()
                with mode, torch.set_grad_enabled(grad):
                    results[i] = fn(items[i])
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                errors[i] = e
            finally:
                _LOCAL.worker = None
                with self.cv:
                    self.state[i] = "done"
                    self._advance()

        threads = [threading.Thread(target=work, args=(i,), daemon=True, name=f"depthscope-pass-{i}") for i in range(n)]
        try:
            for t in threads:
                t.start()
            with self.cv:
                self._advance()
                while any(s != "done" for s in self.state):
                    self.cv.wait()
        except BaseException:
            with self.cv:
                self.abort = True
                self.cv.notify_all()
            raise
        finally:
            for t in threads:
                t.join()
            self._close()
        if self.failure is not None:
            raise self.failure
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results

    def _close(self) -> None:
        if self.loaded is not None:
            self.streamer.leave(self.loaded)
            self.loaded = None
        self.streamer.drain()
        self._show(self.base)
        if self.spill_dir is not None:
            self.spill_dir.cleanup()
        self.bar.close()

    # ------------------------------------------------------------------ turns (the lock held)
    def _view(self) -> tuple:
        """The model's block list as it is now, and the config's ``layer_types`` (both rearranged
        by :func:`~depthscope.hooks.block_start.from_block` and
        :func:`~depthscope.hooks.block_order.block_order` for the worker running)."""
        return dict(self.blocks._modules), getattr(self.config, "layer_types", None)

    def _show(self, view: tuple) -> None:
        """Put a worker's block list in place (in the same dict: a forward iterating it sees it)."""
        modules, types = view
        self.blocks._modules.update(modules)
        if types is not None:
            self.config.layer_types = types

    def _advance(self) -> None:
        """Give the turn to the next worker: one not started, else one waiting at the block in
        place, else (every worker waiting or done) put the lowest block any waits at in place:
        forwards that run the blocks in increasing order (from block 0 or from a later one) then
        find each block in place once."""
        state = self.state
        nxt = next((i for i, s in enumerate(state) if s == "new"), None)
        if nxt is None and self.loaded is not None:
            nxt = next((i for i, s in enumerate(state) if s == self.loaded and isinstance(s, int)), None)
        if nxt is None:
            waiting = [s for s in state if isinstance(s, int) and not isinstance(s, bool)]
            if waiting and not self.abort:
                layer = min(waiting)
                try:
                    self._load(layer)
                    nxt = state.index(layer)
                except BaseException as e:  # noqa: BLE001 - the pass fails with it
                    self.failure, self.abort = e, True
        self.turn = nxt
        self.cv.notify_all()

    def _load(self, layer: int) -> None:
        if self.loaded is not None:
            self.streamer.leave(self.loaded)
            self.loaded = None
        self.streamer.enter(layer, self.next_of.get(layer))
        self.loaded = layer
        self.bar.update(1)

    def park(self, i: int, layer: int, next_layer: int | None, hidden) -> None:
        """Worker ``i`` waits at block ``layer`` (its input ``hidden``) until the block is in place
        and its turn comes; ``next_layer``: the block its forward runs after this one."""
        with self.cv:
            self.next_of[layer] = next_layer
            self.state[i] = layer
            self.views[i] = self._view()  # this worker's block list, back in place at its turn
            spilled = self._park(hidden)
            self._advance()
            while not (self.turn == i and self.loaded == layer) and not self.abort:
                self.cv.wait()
            if not spilled and isinstance(hidden, torch.Tensor):
                self.held -= _nbytes(hidden)
            if self.abort:
                raise _Aborted
            self.state[i] = "run"
            self._show(self.views.pop(i))
        if spilled:
            _restore(hidden, spilled)

    def _park(self, hidden) -> str | None:
        """Count a waiting stream, or write it to the spill file past :data:`SPILL_BYTES`."""
        if not isinstance(hidden, torch.Tensor) or hidden.device.type != "cpu":
            return None
        size = _nbytes(hidden)
        if self.held + size <= SPILL_BYTES:
            self.held += size
            return None
        if self.spill_dir is None:
            self.spill_dir = tempfile.TemporaryDirectory(prefix="depthscope-pass-")
        fd, path = tempfile.mkstemp(dir=self.spill_dir.name, suffix=".stream")
        os.close(fd)
        storage = hidden.untyped_storage()
        # a copy: numpy pins the size of a storage it views
        torch.empty(0, dtype=torch.uint8).set_(storage).clone().numpy().tofile(path)
        storage.resize_(0)  # every view of the stream (the model's own loop holds one) loses its memory
        return path


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _restore(hidden: torch.Tensor, path: str) -> None:
    """The spilled stream's bytes back into its storage (so every view of it sees them)."""
    data = np.fromfile(path, dtype=np.uint8)
    storage = hidden.untyped_storage()
    storage.resize_(len(data))
    torch.empty(0, dtype=torch.uint8).set_(storage).copy_(torch.from_numpy(data))
    os.unlink(path)
