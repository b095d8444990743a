"""An attribution graph against the backward passes it needs, on the default model (issue 67).

==============  ===================================================================================
figure          what is measured
==============  ===================================================================================
depthscope      :func:`~depthscope.analyses.attribution_graph` of a 16-token prompt with up
                to ``FEATURES`` feature rows (``--quick``: 512; full: 2,048), batch 64: the clean
                forward of the replacement model, the kept forward of 64 copies, one backward per
                batch of targets, the contractions, the influence ordering, the bias forward;
                seconds per graph
floor           the passes the graph cannot avoid, in plain torch on the same weights
                (:class:`_Floor`): the frozen linear model's forward of 64 copies (values, the
                clean patterns, ``W_O``, fixed norm scales; no query, key, softmax or MLP), then
                ``n_backward`` backward passes from every MLP input and the final norm's output
                to the embeddings and every MLP write -- the graph's own count,
                ``ceil(logits / 64) + ceil(feature rows / 64)``; a few are timed per round and the
                floor takes their median times the count -- plus two single-prompt forwards of
                the model (the graph's clean forward and its bias forward)
peak memory     the kernel's high-water mark (VmHWM) of a fresh subprocess that loads the model,
                builds the transcoders and one graph of a 1,024-token prompt
==============  ===================================================================================

Transcoders: random TopK transcoders (``LATENTS`` = 4,608 latents, 8x the width of the model,
``K`` = 32) on all 30 layers, float32. Their weights are random, so the features are not
meaningful, but every position has exactly ``K`` active features per layer (16,320 active
features on 17 tokens, as many as a trained set of this width and k), which is what the cost
depends on. Threads pinned (``--threads``), both arms warmed up, then run in turn for ``ROUNDS``
rounds; one thread: CPU seconds of the process; the ratio is the median of the per-round ratios.
Goal: <= 1.5x.

    python -m benchmarks.bench_attribution [--quick] [--threads 1] [--memory-tokens 1024]

``run(quick, threads) -> list[dict]`` returns the rows for ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

GOAL = 1.5
MEMORY_GOAL_MB = 4096
LATENTS, K, BATCH = 4608, 32, 64
FEATURES = {True: 512, False: 2048}
ROUNDS = {True: 3, False: 3}
#: a 16-token prompt on SmolLM2's tokenizer (which prepends no BOS)
PROMPT = "When Mary and John went to the store, John gave a drink to the girl"


def random_transcoders(d: int, n_layers: int, latents: int = LATENTS, k: int = K, seed: int = 0) -> dict:
    """``{layer: SAE}`` of random TopK transcoders reading ``l.mlp_in`` and writing ``l.mlp_out``."""
    from depthscope.hooks.sae import SAE

    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(n_layers):
        out[layer] = SAE(
            W_enc=torch.randn(d, latents, generator=g) / d**0.5,
            b_enc=torch.zeros(latents),
            W_dec=torch.randn(latents, d, generator=g) / latents**0.5,
            b_dec=torch.zeros(d),
            architecture="topk_transcoder",
            hook_name=f"blocks.{layer}.ln2.hook_normalized",
            hook_name_out=f"blocks.{layer}.hook_mlp_out",
            k=k,
        )
    return out


def _clock(threads: int):
    return time.process_time if threads == 1 else time.perf_counter


class _Floor:
    """The bare passes in plain torch, on the default model's weights (Llama layout: RMSNorm,
    grouped key/value heads): the frozen, linear model the graph differentiates, written out
    layer by layer -- ``ln1`` as a fixed scale, values ``h @ W_V``, the clean pattern times the
    values, ``W_O``, ``ln2`` as a fixed scale (the transcoders' input), the MLP's write a leaf --
    then backward passes from every layer's MLP input and the final norm's output to the
    embeddings and every MLP write. No query, key, softmax or MLP: the graph needs none of them.
    The patterns and scales are the prompt's (read once from a clean forward)."""

    def __init__(self, model, ids: torch.Tensor, batch: int):
        from depthscope.analyses.circuits.features.replacement import replacement_model

        self.hf, self.ids, self.batch = model.hf_model, ids, batch
        rm = replacement_model(model, {}, ids[0])  # the clean patterns and norm scales, no transcoders
        layers = self.hf.model.layers
        self.scale1 = [n.gain / n.sigma for n in rm.ln1]
        self.scale2 = [n.gain / n.sigma for n in rm.ln2]
        self.scalef = rm.final_norm.gain / rm.final_norm.sigma
        self.patterns = [p[0] for p in rm.patterns]  # [heads, pos, pos]
        self.W_V = [layer.self_attn.v_proj.weight.T for layer in layers]  # [d, kv_heads * head_dim]
        self.W_O = [layer.self_attn.o_proj.weight.T for layer in layers]  # [heads * head_dim, d]
        self.n_heads = rm.patterns[0].shape[1]
        self.head_dim = self.W_O[0].shape[0] // self.n_heads
        self.embed = rm.embed
        self.mlp_out = rm.mlp_out
        self.g = torch.Generator().manual_seed(1)
        self.rm = rm

    def check(self) -> float:
        """The largest difference between this model's outputs and the graph's own frozen forward
        (``ReplacementModel.run``), relative to the largest output: the floor computes the same
        model (measured: 1e-7)."""
        with torch.no_grad():
            _, reads = self._forward()
            out = self.rm.run(self.rm.clean_sources(self.batch))
        theirs = [*out.mlp_in, out.final]
        return max(float((a - b).abs().max()) for a, b in zip(reads, theirs)) / float(out.final.abs().max())

    def single_forward(self) -> None:
        """The clean forward of one prompt (the graph's first pass, and its bias pass)."""
        with torch.no_grad():
            self.hf.model(input_ids=self.ids)

    def _forward(self):
        B, (n, d) = self.batch, self.embed.shape
        x0 = self.embed.expand(B, n, d).clone().requires_grad_(True)
        leaves = [m.expand(B, n, d).clone().requires_grad_(True) for m in self.mlp_out]
        x, reads = x0, []
        for layer in range(len(leaves)):
            v = (x * self.scale1[layer]) @ self.W_V[layer]  # [B, pos, kv * hd]
            v = v.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # [B, kv, pos, hd]
            v = v.repeat_interleave(self.n_heads // v.shape[1], dim=1)  # [B, heads, pos, hd]
            z = (self.patterns[layer] @ v).transpose(1, 2).flatten(-2)  # [B, pos, heads * hd]
            x = x + z @ self.W_O[layer]
            reads.append(x * self.scale2[layer])  # the transcoder's input
            x = x + leaves[layer]
        reads.append(x * self.scalef)
        return [x0, *leaves], reads

    def passes(self, n_backward: int, clock) -> tuple[float, list[float]]:
        """Seconds of the batched forward and of each of ``n_backward`` backward passes."""
        t = clock()
        with torch.enable_grad():
            leaves, reads = self._forward()
        fwd = clock() - t
        times = []
        for _ in range(n_backward):
            vs = [torch.randn(r.shape, generator=self.g) for r in reads]
            t = clock()
            torch.autograd.grad(reads, leaves, vs, retain_graph=True)
            times.append(clock() - t)
        return fwd, times


def run(quick: bool = False, threads: int = 1, memory: bool | None = None, measured_backwards: int = 4) -> list[dict]:
    """The timing row, and the memory row (``memory``; default: unless ``quick``)."""
    from depthscope.analyses import attribution_graph
    from depthscope.hooks import load_model

    torch.set_num_threads(threads)
    clock = _clock(threads)
    model = load_model(dtype=torch.float32)
    transcoders = random_transcoders(model.d_model, model.n_layers)
    ids = model._prepare(PROMPT, None)[0]
    n_feat = FEATURES[quick]

    def graph():
        return attribution_graph(model, transcoders, PROMPT, max_feature_nodes=n_feat, batch_size=BATCH)

    g = graph()  # warm-up, and the counts
    n_backward = int(g.settings["n_backward_passes"])
    expect = math.ceil(len(g.logit_tokens) / BATCH) + math.ceil(g.settings["n_feature_rows"] / BATCH)
    assert n_backward == expect, (n_backward, expect)
    floor = _Floor(model, ids, BATCH)
    assert floor.check() < 1e-5, "the floor's frozen model is not the graph's"
    floor.passes(1, clock)
    ours, floors, backward = [], [], []
    for _ in range(ROUNDS[quick]):
        t = clock()
        graph()
        ours.append(clock() - t)
        t = clock()
        floor.single_forward()
        floor.single_forward()
        singles = clock() - t
        fwd, bwd = floor.passes(measured_backwards, clock)
        backward.append(statistics.median(bwd))
        floors.append(singles + fwd + n_backward * backward[-1])
    ratio = statistics.median(a / b for a, b in zip(ours, floors))
    rows = [
        {
            "figure": (
                f"attribution graph, {ids.shape[1]} tokens, {g.settings['n_feature_rows']:,} feature rows of "
                f"{g.settings['n_active_features']:,} active ({LATENTS} x k {K} random TopK transcoders), "
                f"{n_backward} backward passes of batch {BATCH} / their floor"
            ),
            "depthscope": statistics.median(ours),
            "baseline": statistics.median(floors),
            "ratio": ratio,
            "goal": GOAL,
            "met": ratio <= GOAL,
            "note": (
                f"one backward of batch {BATCH}: median {statistics.median(backward):.3g} s; "
                f"per round depthscope {', '.join(f'{x:.1f}' for x in ours)} s, floor "
                f"{', '.join(f'{x:.1f}' for x in floors)} s; {threads} thread(s), "
                f"{'cpu' if threads == 1 else 'wall'} seconds"
            ),
        }
    ]
    if (not quick) if memory is None else memory:
        rows.append(memory_row(threads))
    return rows


def graph_memory(n_tokens: int = 1024, max_feature_nodes: int = 2048, batch_size: int = BATCH) -> dict:
    """In the subprocess: load the model, build the transcoders, one graph of ``n_tokens`` tokens."""
    from benchmarks._common import _status_kb, text_ids
    from depthscope.analyses import attribution_graph
    from depthscope.hooks import load_model

    model = load_model(dtype=torch.float32)
    transcoders = random_transcoders(model.d_model, model.n_layers)
    ids = text_ids(model, n_tokens)
    before = _status_kb("VmHWM")
    t = time.perf_counter()
    g = attribution_graph(model, transcoders, ids, max_feature_nodes=max_feature_nodes, batch_size=batch_size)
    return {
        "peak_mb": _status_kb("VmHWM") / 1024,
        "peak_before_graph_mb": before / 1024,
        "seconds": time.perf_counter() - t,
        "adjacency_mb": (g.adjacency.data.nbytes + g.adjacency.indices.nbytes + g.adjacency.indptr.nbytes) / 2**20,
        "nnz": int(g.adjacency.nnz),
        "n_feature_rows": int(g.settings["n_feature_rows"]),
        "n_active_features": int(g.settings["n_active_features"]),
        "n_backward_passes": int(g.settings["n_backward_passes"]),
    }


def memory_row(threads: int, n_tokens: int = 1024, max_feature_nodes: int = 2048, batch_size: int = BATCH) -> dict:
    from benchmarks._common import peak_memory

    m = peak_memory(
        "bench_attribution",
        "graph_memory",
        threads,
        n_tokens=n_tokens,
        max_feature_nodes=max_feature_nodes,
        batch_size=batch_size,
    )
    return {
        "figure": (
            f"attribution graph peak RSS, {n_tokens}-token prompt, {m['n_feature_rows']:,} feature rows of "
            f"{m['n_active_features']:,} active, batch {batch_size} (fresh subprocess) / 4 GB"
        ),
        "depthscope": f"{m['peak_mb']:.0f} MB",
        "baseline": f"{MEMORY_GOAL_MB} MB",
        "ratio": m["peak_mb"] / MEMORY_GOAL_MB,
        "goal": 1.0,
        "met": m["peak_mb"] <= MEMORY_GOAL_MB,
        "note": (
            f"{m['peak_before_graph_mb']:.0f} MB before the graph (model and transcoders); adjacency "
            f"{m['adjacency_mb']:.0f} MB ({m['nnz']:,} entries); {m['n_backward_passes']} backward passes "
            f"in {m['seconds']:.0f} s"
        ),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--memory-only", action="store_true", help="only the peak-memory row")
    p.add_argument("--no-memory", action="store_true", help="only the timing row")
    p.add_argument("--memory-tokens", type=int, default=1024)
    p.add_argument("--memory-features", type=int, default=2048)
    p.add_argument("--memory-batch", type=int, default=BATCH)
    a = p.parse_args(argv)
    from benchmarks._common import Settings

    Settings(threads=a.threads).pin()
    if a.memory_only:
        rows = [memory_row(a.threads, a.memory_tokens, a.memory_features, a.memory_batch)]
    else:
        rows = run(a.quick, a.threads, memory=False if a.no_memory else None)
    for row in rows:
        print(row, flush=True)


if __name__ == "__main__":
    if not __package__:  # run as a file: depthscope from the environment
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
