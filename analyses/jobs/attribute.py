"""The attribution job (``depthscope attribute``): one prompt's attribution graph over a transcoder
set, pruned, scored, written as files a user reloads, drawn, and viewed in a browser.

=========================  ======================================================================
:func:`attribute_job`      a model, a transcoder set and a prompt -> ``OUT``: ``nodes.parquet``,
                           ``adjacency.npz``, ``attribution_summary.json``, ``graph.json`` and
                           ``graph-metadata.json`` (circuit-tracer's/Neuronpedia's), the figure
                           ``attribution_graph`` (PNG and SVG) and ``attribution.html``
:func:`target_ids`         ``--targets`` -> token ids, each one token of the vocabulary
:func:`top_tokens`         the tokens each kept feature's decoder writes to most
:func:`summary_table`      the console table of the summary
=========================  ======================================================================

The graph is :func:`~depthscope.analyses.circuits.features.attribute.attribution_graph` (frozen
attention and norm scales, transcoders + error nodes, direct effects by batched backward passes);
the pruning and both scores are circuit-tracer's
(:mod:`~depthscope.analyses.circuits.features.prune`). A feature's top tokens are the largest
entries of its decoder row times the unembedding (``W_dec[f] @ W_U``, no final norm: the
direction it writes, as Neuronpedia's "top logits" read it). Its settings are
:class:`~depthscope.analyses.circuits.features.config.AttributeConfig`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from rich.markup import escape
from rich.table import Table

from depthscope.analyses.circuits.features.attribute import attribution_graph
from depthscope.analyses.circuits.features.config import MAX_PROMPT_TOKENS, AttributeConfig
from depthscope.analyses.circuits.features.export import node_table, write_graph
from depthscope.analyses.circuits.features.graph import AttributionGraph
from depthscope.analyses.circuits.features.html import attribution_html
from depthscope.analyses.circuits.features.plots import plot_attribution_graph
from depthscope.analyses.circuits.features.prune import PrunedGraph, graph_scores, prune_graph
from depthscope.analyses.jobs.base import JobResult, Output
from depthscope.common.errors import InputError
from depthscope.hooks.transcoder_set import load_transcoder_set

__all__ = ["AttributeResult", "attribute_job", "target_ids", "top_tokens", "summary_table"]


def target_ids(tokenizer, targets: str | None) -> list[int] | None:
    """The token ids of comma-separated ``targets`` (None: the salient logits); a target that is
    not one token of the vocabulary is an error naming it and what it tokenises to."""
    if targets is None:
        return None
    ids = []
    for t in (t for t in targets.split(",") if t):
        enc = tokenizer.encode(t, add_special_tokens=False)
        if len(enc) != 1:
            pieces = [tokenizer.decode([i]) for i in enc]
            raise InputError(f"--targets {t!r} is {len(enc)} tokens ({pieces!r}), not one token of the vocabulary")
        ids.append(int(enc[0]))
    return ids


def top_tokens(model, transcoders: dict, graph, rows, k: int) -> dict[int, list[str]]:
    """``{adjacency index: the k tokens feature node i's decoder writes to most}`` for the feature
    nodes ``rows`` (``W_dec[f] @ W_U``, no final norm)."""
    if k == 0 or len(rows) == 0:
        return {}
    W_U = model.unembed.W_U.detach()
    out = {}
    for i in rows:
        layer, _, f = (int(v) for v in graph.features[i])
        w = transcoders[layer].W_dec[f].detach().to(W_U.device, W_U.dtype)
        ids = torch.topk(w @ W_U, k).indices.tolist()
        out[int(i)] = [model.tokenizer.decode([j]) for j in ids]
    return out


@dataclass
class AttributeResult(JobResult):
    """:class:`JobResult` (``tables["nodes"]``, the summary, the files) plus the graph and its pruning."""

    graph: AttributionGraph | None = None
    pruned: PrunedGraph | None = None


def attribute_job(model, config: AttributeConfig, out: Output) -> AttributeResult:
    """The graph of ``config.prompt`` under the transcoder set ``config.transcoders``, written to
    ``out`` (nothing written for ``Output(None)``)."""
    if model.tokenizer is None:
        raise InputError(f"{model.name} has no tokenizer: depthscope attribute reads a text prompt")
    n_tokens = len(model.tokenizer.encode(config.prompt))
    if n_tokens > MAX_PROMPT_TOKENS:
        raise InputError(f"--prompt is {n_tokens} tokens; depthscope attribute takes at most {MAX_PROMPT_TOKENS}")
    transcoders = load_transcoder_set(config.transcoders, device=model.device)
    start = time.perf_counter()
    graph = attribution_graph(
        model,
        transcoders,
        config.prompt,
        targets=target_ids(model.tokenizer, config.targets),
        max_feature_nodes=config.max_feature_nodes,
        desired_logit_prob=config.logit_probability,
        max_n_logits=config.max_logits,
        batch_size=config.batch_size,
    )
    graph.model_name = model.name
    graph.settings = {**graph.settings, "transcoders": str(config.transcoders), "seconds": time.perf_counter() - start}
    pruned = prune_graph(graph, config.node_threshold, config.edge_threshold)
    table = node_table(graph, pruned)
    summary = {
        "model": model.name,
        "prompt": config.prompt,
        "targets": list(graph.logit_strings),
        **graph_scores(graph, pruned),
        "n_features": graph.n_features,
        "pruned_n_features": int((table["in_pruned_graph"] & (table["kind"] == "feature")).sum()),
        "pruned_n_edges": int(pruned.edge_mask.nnz),
        "seconds": graph.settings["seconds"],
    }
    result = AttributeResult(tables={"nodes": table}, summary=summary, graph=graph, pruned=pruned)
    if out.folder is None:
        return result
    kept = [i for i in range(graph.n_features) if pruned.node_mask[i]]
    tops = top_tokens(model, transcoders, graph, kept, config.top_tokens)
    files = write_graph(graph, out.folder, pruned=pruned)
    out.figure(plot_attribution_graph, graph, pruned=pruned, top_tokens=tops, name="attribution_graph")
    page = attribution_html(graph, out.folder / "attribution.html", pruned=pruned, top_tokens=tops)
    result.files = [*files.values(), *out.written, page]
    return result


def summary_table(summary: dict) -> Table:
    """The console table of :func:`attribute_job`'s summary."""
    t = Table(title=f"attribution graph: {escape(summary['prompt'])!s} ({escape(summary['model'])})")
    t.add_column("measure")
    t.add_column("value", justify="right")
    for k, v in summary.items():
        if k not in ("prompt", "model"):
            t.add_row(k, f"{v:.4f}" if isinstance(v, float) else escape(str(v)))
    return t
