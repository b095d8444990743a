"""Generation with hooks: transformers' ``generate`` with depthscope hook functions at every step.

>>> def steer(t, ctx):                       # add a direction to the stream at every step
...     return t + 4.0 * direction
>>> out = model.generate(["The capital of France is"], max_new_tokens=8, hooks={"10.attn": steer})
>>> out.text[0], out.tokens[0]               # the new text and token ids of each prompt

Hooks are those of :mod:`depthscope.hooks.run` (any hook point, TransformerLens aliases too) and
run at every forward of ``generate``: the prompt (``ctx.step == 0``, all prompt positions) and
each new token (``ctx.step == k``, one row per prompt; ``ctx.positions`` its absolute position,
``ctx.mask`` the whole sequence so far). Greedy decoding unless generation kwargs say otherwise
(``do_sample=True, temperature=...``...); the key/value cache is used as usual, so a hook at step
``k`` sees only the new token's row, as the model computes it. ``cache=[names]`` keeps those
points at every step (``out.cache["5.pattern"][k]``: ``[batch, heads, 1, keys so far]`` for
k > 0). Batches are left-padded (decoders continue from the last real token). Hooks are removed
afterwards, also on error. Encoders (BERT-style) do not generate and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthscope.common.errors import InputError, UnsupportedArchitecture
from depthscope.hooks.points import parse_points
from depthscope.hooks.run import PADDING_SIDES, Attached, Hooks, _State, normalise_hooks, position_ids


@dataclass
class Generation:
    """``sequences`` ``[batch, prompt + new]`` (prompts as padded), ``prompt_mask``, and per prompt
    the new ``tokens`` (LongTensor, up to and including the first end-of-sequence token) and
    their ``text`` (special tokens skipped)."""

    sequences: torch.Tensor
    prompt_mask: torch.Tensor
    tokens: list[torch.Tensor]
    text: list[str]
    steps: int  # forwards made (prompt + new tokens)
    cache: dict  # name -> list over steps of the cached tensor (step 0: the prompt; then one row per prompt)


def generate(
    model,
    prompts,
    *,
    max_new_tokens: int = 20,
    hooks: Hooks = None,
    cache=None,
    padding_side: str = "left",
    mask: torch.Tensor | None = None,
    **generation_kwargs,
) -> Generation:
    """Continue ``prompts`` (strings or token ids) for ``max_new_tokens`` with ``hooks`` at every
    step; ``cache`` (names, as in ``run``) keeps those points at every step."""
    if not model.is_decoder:
        raise UnsupportedArchitecture(
            f"{model.name} is an encoder ({model.arch.family}): it has no next-token head and cannot generate; "
            f"use model.run(...) for a forward with hooks"
        )
    if padding_side not in PADDING_SIDES:
        raise InputError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    ids, mask = model._prepare(prompts, mask, padding_side=padding_side)
    if not bool(mask[:, -1].all()):
        raise InputError(
            "generate continues each prompt after its last token: pad the batch on the left (padding_side='left')"
        )
    user = normalise_hooks(hooks, model.n_layers)
    points = parse_points(cache, model.n_layers)
    state = _State(step=-1)
    att = Attached(model, points, user, state=state)
    per_step: dict = {p.name: [] for p in points}

    def flush():
        for k, v in att.store.items():
            per_step[k].append(v)
        att.store.clear()

    def on_forward(mod, args, kwargs):
        """Before each forward of generate: the step, the mask so far and the new rows' positions."""
        flush()
        state.step += 1
        m = kwargs.get("attention_mask")
        x = kwargs.get("input_ids")
        n_new = x.shape[1] if x is not None else kwargs["inputs_embeds"].shape[1]
        state.mask = m.bool() if m is not None else None
        pos = kwargs.get("position_ids")
        if pos is None:
            full = (
                state.mask
                if state.mask is not None
                else torch.ones(ids.shape[0], n_new, dtype=torch.bool, device=ids.device)
            )
            pos = position_ids(full)[:, -n_new:]
        state.positions = pos.expand(ids.shape[0], -1)
        return None

    tok = model.tokenizer
    kwargs = {"do_sample": False, **generation_kwargs}
    if tok is not None and tok.pad_token_id is not None:
        kwargs.setdefault("pad_token_id", tok.pad_token_id)
    handle = model.hf_model.register_forward_pre_hook(on_forward, with_kwargs=True)
    try:
        with att, torch.no_grad():
            seq = model.hf_model.generate(
                input_ids=ids, attention_mask=mask.long(), max_new_tokens=max_new_tokens, **kwargs
            )
    finally:
        handle.remove()
    flush()
    tokens = _new_tokens(model, seq[:, ids.shape[1] :])
    text = [tok.decode(t, skip_special_tokens=True) for t in tokens] if tok is not None else []
    return Generation(sequences=seq, prompt_mask=mask, tokens=tokens, text=text, steps=state.step + 1, cache=per_step)


def _new_tokens(model, new: torch.Tensor) -> list[torch.Tensor]:
    """Each row's new tokens up to and including its first end-of-sequence token."""
    eos = getattr(model.hf_model.generation_config, "eos_token_id", None)
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    tokens = []
    for row in new:
        stop = next((i + 1 for i, t in enumerate(row.tolist()) if t in eos), len(row))
        tokens.append(row[:stop].cpu())
    return tokens
