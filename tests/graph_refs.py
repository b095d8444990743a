"""Plain-torch references for circuits as graphs (tests only): transformers models, torch hooks on
their modules, nothing of depthscope's engine.

A receiver's input gradient is measured by brute force: the receiver gets its own copy of the
residual stream ``x + delta`` (delta a zero leaf), its projection recomputed from that copy by hand
(``F.linear`` / GPT-2's ``x W + b``), and ``dm/d delta`` read after one backward. Grouped-query
Llamas are first *ungrouped* (every query head its own key/value head, the weights repeated), an
equivalent model in which a query head's key and value inputs are separate tensors. The senders'
writes are read with forward hooks: block 0's input, each head's term of the output projection,
each MLP's output. :func:`reference_scores` is EAP from those pieces; :func:`ablated_metric` is the
clean run with one edge's receiver fed ``x + a_u(corrupted) - a_u(clean)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def parts(model):
    """(layers, final norm, family) of a tiny transformers model."""
    kind = type(model).__name__
    if kind.startswith("GPT2"):
        return model.transformer.h, model.transformer.ln_f, "gpt2"
    if kind.startswith("GPTNeoX"):
        return model.gpt_neox.layers, model.gpt_neox.final_layer_norm, "neox"
    return model.model.layers, model.model.norm, "llama"


def block(layer, family):
    """(ln1, ln2, qkv projections (3 modules, fused ones three times), output projection, mlp)."""
    if family == "gpt2":
        a = layer.attn
        return layer.ln_1, layer.ln_2, (a.c_attn,) * 3, a.c_proj, layer.mlp
    if family == "neox":
        a = layer.attention
        return layer.input_layernorm, layer.post_attention_layernorm, (a.query_key_value,) * 3, a.dense, layer.mlp
    a = layer.self_attn
    return layer.input_layernorm, layer.post_attention_layernorm, (a.q_proj, a.k_proj, a.v_proj), a.o_proj, layer.mlp


def linear(module, x):
    """A Linear or GPT-2 Conv1D applied by hand (no module call: no hooks run)."""
    if type(module).__name__ == "Conv1D":
        return x @ module.weight + module.bias
    return F.linear(x, module.weight, module.bias)


def head_slice(family, part: int, head: int, n_heads: int, d_head: int) -> slice:
    """Where head ``head``'s query (0), key (1) or value (2) sits in its projection's output."""
    if family == "gpt2":
        start = part * n_heads * d_head + head * d_head
    elif family == "neox":
        start = head * 3 * d_head + part * d_head
    else:
        start = head * d_head
    return slice(start, start + d_head)


def ungroup(model):
    """A Llama whose key/value heads are one per query head (weights repeated): the same function."""
    import transformers as tf

    cfg = model.config
    rep = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    if rep == 1:
        return model
    new = tf.LlamaForCausalLM(tf.LlamaConfig(**{**cfg.to_dict(), "num_key_value_heads": cfg.num_attention_heads}))
    state = model.state_dict()
    dh = cfg.hidden_size // cfg.num_attention_heads
    for k, v in list(state.items()):
        if k.endswith(("k_proj.weight", "v_proj.weight")):
            state[k] = v.view(cfg.num_key_value_heads, dh, -1).repeat_interleave(rep, 0).reshape(-1, v.shape[-1])
        if k.endswith(("k_proj.bias", "v_proj.bias")):
            state[k] = v.view(cfg.num_key_value_heads, dh).repeat_interleave(rep, 0).reshape(-1)
    new.load_state_dict(state)
    return new.eval()


def metric(logits, target: int, foil: int):
    return logits[:, -1, target] - logits[:, -1, foil]


def _hidden(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def sender_writes(model, ids) -> list[torch.Tensor]:
    """The senders' writes ``[P, d]`` in the graph's order: block 0's input, then per layer each
    head's term of the output projection (no bias) and the MLP's output."""
    layers, _, family = parts(model)
    cfg = model.config
    H = cfg.num_attention_heads
    out, handles = {}, []
    handles.append(
        layers[0].register_forward_pre_hook(lambda m, a, k: out.__setitem__("embed", _hidden(a, k)), with_kwargs=True)
    )
    for i, layer in enumerate(layers):
        _, _, _, o_proj, mlp = block(layer, family)
        handles.append(o_proj.register_forward_pre_hook(lambda m, a, i=i: out.__setitem__(f"z{i}", a[0])))
        handles.append(mlp.register_forward_hook(lambda m, a, o, i=i: out.__setitem__(f"m{i}", o)))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    writes = [out["embed"][0]]
    for i, layer in enumerate(layers):
        o_proj = block(layer, family)[3]
        z = out[f"z{i}"][0]
        dh = z.shape[-1] // H
        W = o_proj.weight if type(o_proj).__name__ == "Conv1D" else o_proj.weight.T  # [H*dh, d]
        writes += [z[:, h * dh : (h + 1) * dh] @ W[h * dh : (h + 1) * dh] for h in range(H)]
        writes.append(out[f"m{i}"][0])
    return writes


def _receiver_hooks(model, receiver: str, extra: torch.Tensor):
    """Hooks feeding ``receiver`` the stream plus ``extra`` ``[1, P, d]`` (a zero leaf, or an
    ablation's difference); returns the handles."""
    layers, final, family = parts(model)
    cfg = model.config
    H = cfg.num_attention_heads
    if receiver == "logits":
        return [final.register_forward_pre_hook(lambda m, a: (a[0] + extra,))]
    layer_s, kind, *head = receiver.split(".")
    layer = layers[int(layer_s)]
    ln1, ln2, projs, _, mlp = block(layer, family)
    if kind == "mlp_in":
        base = {}
        h1 = ln2.register_forward_pre_hook(lambda m, a: base.__setitem__("x", a[0]))
        h2 = mlp.register_forward_pre_hook(lambda m, a: (ln2(base["x"] + extra),))
        return [h1, h2]
    part, h = "qkv".index(kind), int(head[0])
    proj = projs[part]
    pre = {}
    h1 = layer.register_forward_pre_hook(lambda m, a, k: pre.__setitem__("x", _hidden(a, k)), with_kwargs=True)

    def swap(m, a, out):
        d_head = cfg.hidden_size // H
        where = head_slice(family, part, h, H, d_head)
        new = out.clone()
        new[..., where] = linear(proj, ln1(pre["x"] + extra))[..., where]
        return new

    return [h1, proj.register_forward_hook(swap)]


def receiver_gradient(model, ids, target: int, foil: int, receiver: str, embeds=None) -> torch.Tensor:
    """dm/dx_receiver ``[P, d]`` on ``ids`` (or on the input embeddings ``embeds`` ``[1, P, d]``)
    by a zero perturbation of that receiver's own input."""
    delta = torch.zeros(1, ids.shape[1], model.config.hidden_size, requires_grad=True)
    handles = _receiver_hooks(model, receiver, delta)
    try:
        out = model(ids) if embeds is None else model(inputs_embeds=embeds)
        metric(out.logits, target, foil).sum().backward()
    finally:
        for h in handles:
            h.remove()
    return delta.grad[0]


def reference_scores(model, pairs, graph, ablated=None) -> dict[tuple[str, str], float]:
    """EAP by brute force: mean over pairs of sum_p (a_u(corr) - a_u(clean)) . dm/dx_v, every edge.
    ``pairs``: (clean ids [1, P], corrupted ids, target id, foil id); ``ablated(clean ids)``: the
    senders' ablated writes ``[P, d]`` each, in place of the corrupted ones."""
    model = ungroup(model)
    total: dict[tuple[str, str], float] = {}
    for clean, corrupted, t, f in pairs:
        other = sender_writes(model, corrupted) if ablated is None else ablated(clean)
        diff = [a - b for a, b in zip(other, sender_writes(model, clean))]
        for r, receiver in enumerate(graph.receivers):
            g = receiver_gradient(model, clean, t, f, receiver)
            for s in range(int(graph.prev[r])):
                key = (graph.senders[s], receiver)
                total[key] = total.get(key, 0.0) + float((diff[s] * g).sum().detach()) / len(pairs)
    return total


def reference_ig_scores(model, pairs, graph, steps: int, ablated=None, start=None) -> dict[tuple[str, str], float]:
    """EAP-IG (inputs) by brute force: as :func:`reference_scores` with the gradient averaged over
    the runs on the input embeddings ``e(corr) + (k / steps) (e(clean) - e(corr))``, k = 0 .. steps - 1
    (token embeddings: the positions are the same in both prompts). ``ablated(clean ids)`` and
    ``start(clean ids)`` (the token embeddings ``[1, P, d]`` the path starts from) replace the
    corrupted writes and embeddings (mean or zero ablation)."""
    model = ungroup(model)
    emb = model.get_input_embeddings()
    total: dict[tuple[str, str], float] = {}
    for clean, corrupted, t, f in pairs:
        other = sender_writes(model, corrupted) if ablated is None else ablated(clean)
        diff = [a - b for a, b in zip(other, sender_writes(model, clean))]
        with torch.no_grad():
            e_clean, e_corr = emb(clean), (emb(corrupted) if start is None else start(clean))
        points = [e_corr + (k / steps) * (e_clean - e_corr) for k in range(steps)]
        for r, receiver in enumerate(graph.receivers):
            g = sum(receiver_gradient(model, clean, t, f, receiver, embeds=p) for p in points) / steps
            for s in range(int(graph.prev[r])):
                key = (graph.senders[s], receiver)
                total[key] = total.get(key, 0.0) + float((diff[s] * g).sum().detach()) / len(pairs)
    return total


def ablated_metric(model, clean, corrupted, t: int, f: int, graph, sender: str, receiver: str) -> float:
    """The clean run's metric with one edge ablated: ``receiver`` reads the stream plus
    ``a_sender(corrupted) - a_sender(clean)`` (the sender's own value is the clean one: nothing
    upstream of it is ablated)."""
    model = ungroup(model)
    s = graph.sender_index[sender]
    diff = (sender_writes(model, corrupted)[s] - sender_writes(model, clean)[s])[None]
    handles = _receiver_hooks(model, receiver, diff)
    try:
        with torch.no_grad():
            return float(metric(model(clean).logits, t, f)[0])
    finally:
        for h in handles:
            h.remove()


def circuit_metric(model, clean, corrupted, t: int, f: int, graph, kept, ablated=None) -> float:
    """The metric of the clean run through a circuit (``kept``: bool ``[senders, receivers]``), by
    hand: each receiver reads ``x + sum over its cut edges of (a_u(ablated) - a_u(this run))``,
    every sender's write taken in this same run (the definition, one receiver at a time);
    ``ablated``: the senders' ablated writes (default: their writes on ``corrupted``)."""
    model = ungroup(model)
    layers, final, family = parts(model)
    cfg = model.config
    H = cfg.num_attention_heads
    d_head = cfg.hidden_size // H
    ablated = sender_writes(model, corrupted) if ablated is None else ablated
    cur: dict[int, torch.Tensor] = {}
    cut = graph.mask & ~kept
    handles = []

    def fed(x, receiver: str):
        r = graph.receiver_index[receiver]
        extra = sum((ablated[s] - cur[s] for s in range(len(graph.senders)) if cut[s, r]), torch.zeros_like(x[0]))
        return x + extra[None]

    def pre0(m, a, k):
        cur[0] = _hidden(a, k)[0]

    handles.append(layers[0].register_forward_pre_hook(pre0, with_kwargs=True))
    for i, layer in enumerate(layers):
        ln1, ln2, projs, o_proj, mlp = block(layer, family)
        start = graph.attn_start(i)
        seen: dict[str, torch.Tensor] = {}
        handles.append(
            layer.register_forward_pre_hook(
                lambda m, a, k, seen=seen: seen.__setitem__("pre", _hidden(a, k)), with_kwargs=True
            )
        )
        for part, proj in enumerate(projs):

            def swap(m, a, out, part=part, proj=proj, ln1=ln1, i=i, seen=seen):
                new = out.clone()
                for h in range(H):
                    where = head_slice(family, part, h, H, d_head)
                    x = fed(seen["pre"], f"{i}.{'qkv'[part]}.{h}")
                    new[..., where] = linear(proj, ln1(x))[..., where]
                return new

            handles.append(proj.register_forward_hook(swap))

        def heads(m, a, start=start, o_proj=o_proj):
            z = a[0][0]
            W = o_proj.weight if type(o_proj).__name__ == "Conv1D" else o_proj.weight.T
            for h in range(H):
                cur[start + h] = z[:, h * d_head : (h + 1) * d_head] @ W[h * d_head : (h + 1) * d_head]

        handles.append(o_proj.register_forward_pre_hook(heads))
        handles.append(ln2.register_forward_pre_hook(lambda m, a, seen=seen: seen.__setitem__("mid", a[0])))
        handles.append(
            mlp.register_forward_pre_hook(lambda m, a, i=i, ln2=ln2, seen=seen: (ln2(fed(seen["mid"], f"{i}.mlp_in")),))
        )
        handles.append(mlp.register_forward_hook(lambda m, a, o, start=start: cur.__setitem__(start + H, o[0])))
    handles.append(final.register_forward_pre_hook(lambda m, a: (fed(a[0], "logits"),)))
    try:
        with torch.no_grad():
            return float(metric(model(clean).logits, t, f)[0])
    finally:
        for h in handles:
            h.remove()


def token_embedding(model, ids) -> torch.Tensor:
    """The token embeddings ``[P, d]`` of ``ids`` ``[1, P]`` (the input node of EAP-IG's graph)."""
    with torch.no_grad():
        return model.get_input_embeddings()(ids)[0]


def position_embedding(model, n: int) -> torch.Tensor:
    """GPT-2's learned position embeddings of positions ``0 .. n-1`` (zeros for rotary models)."""
    if type(model).__name__.startswith("GPT2"):
        return model.transformer.wpe.weight[:n].detach()
    return torch.zeros(n, model.config.hidden_size)


def mean_writes(model, prompts, n: int) -> list[torch.Tensor]:
    """Mean ablation's values ``[n, d]`` per sender from ``prompts`` (ids ``[1, P]``), by hand: per
    position when every prompt has ``n`` tokens, else each prompt's positions 1 .. averaged, then
    the prompts; ``embed`` is the token embedding alone (the position's own embedding added back)."""
    model = ungroup(model)
    per = []
    for ids in prompts:
        w = sender_writes(model, ids)
        w[0] = token_embedding(model, ids)
        per.append(w)
    out = []
    for s in range(len(per[0])):
        if all(p[s].shape[0] == n for p in per):
            out.append(torch.stack([p[s] for p in per]).mean(0))
        else:
            out.append(torch.stack([p[s][1:].mean(0) for p in per]).mean(0).expand(n, -1).clone())
    out[0] = out[0] + position_embedding(model, n)
    return out


# ----------------------------------------------------------------------------- EAP-IG's Graph, by name
def _owner_of(receiver: str) -> str | None:
    """The node a receiver feeds, by its name: ``l.q.h`` -> ``l.heads.h``, ``l.mlp_in`` -> ``l.mlp_out``."""
    if receiver == "logits":
        return None
    layer, kind, *head = receiver.split(".")
    return f"{layer}.mlp_out" if kind == "mlp_in" else f"{layer}.heads.{head[0]}"


def eap_ig_prune(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """EAP-IG's ``Graph.prune`` rule on a set of (sender, receiver) edges, written from its code:
    repeat { a node is in the graph iff it has an outgoing edge and an incoming edge into one of its
    inputs (the input node always counts as fed); keep the edges whose parent is in the graph and
    whose child's node is (the logits always) } until neither the nodes nor the edges change."""
    nodes: set[str] | None = None
    while True:
        outgoing = {s for s, _ in edges}
        incoming = {_owner_of(r) for _, r in edges} | {"embed"}
        new_nodes = outgoing & incoming
        new_edges = {(s, r) for s, r in edges if s in new_nodes and (r == "logits" or _owner_of(r) in new_nodes)}
        if new_nodes == nodes and new_edges == edges:
            return edges
        nodes, edges = new_nodes, new_edges


def read_mib_graph(d: dict) -> tuple[set[str], set[str], dict[str, float]]:
    """A circuit JSON read as MIB's ``Graph.from_json`` (EAP-IG's ``Graph``) reads it, written from
    its code: the graph built from ``cfg`` alone (``Graph.from_model``: nodes ``input``,
    ``a<l>.h<h>``, ``m<l>``, ``logits``; edges ``parent->child<q|k|v>`` from every node of the
    residual stream so far, the MLP after its layer's heads unless ``parallel_attn_mlp``), then each
    node's and edge's ``in_graph`` (and score) set by name; an unknown name is a KeyError there, an
    error here. Returns (edges in the graph, nodes in the graph, every edge's score)."""
    cfg = d["cfg"]
    layers, heads, parallel = cfg["n_layers"], cfg["n_heads"], cfg["parallel_attn_mlp"]
    stream, names = ["input"], []
    for layer in range(layers):
        attn, mlp = [f"a{layer}.h{h}" for h in range(heads)], f"m{layer}"
        names += [f"{n}->{a}<{x}>" for n in stream for a in attn for x in "qkv"]
        if parallel:
            names += [f"{n}->{mlp}" for n in stream]
            stream += attn + [mlp]
        else:
            stream += attn
            names += [f"{n}->{mlp}" for n in stream]
            stream.append(mlp)
    names += [f"{n}->logits" for n in stream]
    unknown = (set(d["nodes"]) - set(stream) - {"logits"}) | (set(d["edges"]) - set(names))
    if unknown:
        raise KeyError(f"names Graph.from_model does not make: {sorted(unknown)[:5]}")
    assert len(names) == len(set(names))
    in_graph = {n for n in names if d["edges"].get(n, {}).get("in_graph", False)}
    nodes = {n for n, v in d["nodes"].items() if v["in_graph"] and n != "logits"}
    scores = {n: float(v["score"]) for n, v in d["edges"].items()}
    return in_graph, nodes, scores


def mib_edge_name(sender: str, receiver: str) -> str:
    """MIB's name of a depthscope edge, written here apart from depthscope's ``mib_name``."""

    def node(n: str) -> str:
        if n in ("embed", "logits"):
            return {"embed": "input", "logits": "logits"}[n]
        layer, kind, *h = n.split(".")
        return f"m{layer}" if kind in ("mlp_out", "mlp_in") else f"a{layer}.h{h[0]}"

    tail = f"<{receiver.split('.')[1]}>" if receiver.count(".") == 2 else ""
    return f"{node(sender)}->{node(receiver)}{tail}"
