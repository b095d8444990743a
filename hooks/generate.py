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

Bounds: the prompt plus ``max_new_tokens`` must fit the model's context (checked before any
forward; a model without a known context gets at most :data:`MAX_NEW_TOKENS`). Logits with NaN or
+inf (or a row of only -inf) at any step stop generation with a
:class:`~depthscope.common.errors.NonFiniteActivationError` that names the step and, when a hook's
replacement made the stream non-finite, the hook point -- never a silent token 0. The check is one
reduction of the ``[batch, vocab]`` logits and of each replacement per step, and reads the result
once per step, when transformers reads its stopping criteria anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthscope.common.errors import ContextLengthError, InputError, NonFiniteActivationError, UnsupportedArchitecture
from depthscope.common.settings import Limit, check_number
from depthscope.hooks.engine import Engine, Hooks, State, normalise_hooks
from depthscope.hooks.points import parse_points
from depthscope.hooks.run import PADDING_SIDES, position_ids

#: new tokens at most for a model whose context is not known from its config
MAX_NEW_TOKENS = 1 << 16


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
    _check_request(model, padding_side, max_new_tokens)
    check_generation_settings(generation_kwargs)
    ids, mask = model._prepare(prompts, mask, padding_side=padding_side)
    if not bool(mask[:, -1].all()):
        raise InputError(
            "generate continues each prompt after its last token: pad the batch on the left (padding_side='left')"
        )
    _check_budget(model, ids.shape[1], max_new_tokens)
    points = parse_points(cache, model.n_layers)
    steps = _Steps(batch=ids.shape[0], device=ids.device, names=[p.name for p in points])
    tok = model.tokenizer
    kwargs = {"do_sample": False, **generation_kwargs}
    if tok is not None and tok.pad_token_id is not None:
        kwargs.setdefault("pad_token_id", tok.pad_token_id)
    user = normalise_hooks(hooks, model.n_layers)
    with Engine(model, points, user, state=steps.state, on_forward=steps.on_forward) as eng, torch.no_grad():
        steps.engine = eng
        kwargs["logits_processor"] = _with_finite_check(kwargs.get("logits_processor"), steps, eng.watch_nonfinite())
        seq = model.hf_model.generate(
            input_ids=ids, attention_mask=mask.long(), max_new_tokens=max_new_tokens, **kwargs
        )
    steps.flush()
    tokens = _new_tokens(model, seq[:, ids.shape[1] :])
    text = [tok.decode(t, skip_special_tokens=True) for t in tokens] if tok is not None else []
    return Generation(
        sequences=seq, prompt_mask=mask, tokens=tokens, text=text, steps=steps.state.step + 1, cache=steps.per_step
    )


#: sequences one prompt may fan out into: one (greedy or sampled), since hooks, the cache per
#: step and the positions hooks see follow the prompts' rows
BEAMS = Limit(1, "generate keeps one sequence per prompt (greedy or sampled); beam search is not supported")
#: the numeric transformers generation settings checked before generating: (minimum, maximum, integer);
#: a float minimum of 0.0 means "greater than 0"
GENERATION_NUMBERS = {
    "num_beams": (1, BEAMS, True),
    "num_return_sequences": (1, BEAMS, True),
    "num_beam_groups": (1, BEAMS, True),
    "top_k": (0, 2**24, True),
    "min_new_tokens": (0, None, True),
    "no_repeat_ngram_size": (0, 2**16, True),
    "temperature": (0.0, 1e4, False),
    "top_p": (0.0, 1.0, False),
    "typical_p": (0.0, 1.0, False),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, 1e4, False),
    "length_penalty": (-1e4, 1e4, False),
}


def check_generation_settings(settings: dict) -> None:
    """Refuse transformers generation settings that would allocate without bound or mean nothing
    (``num_beams=10**9``, ``temperature=nan``...) with the setting named; ``max_length`` is refused
    for ``max_new_tokens``, which the context check bounds."""
    if "max_length" in settings:
        raise InputError("give max_new_tokens (checked against the model's context), not max_length")
    for name, (low, high, integer) in GENERATION_NUMBERS.items():
        if settings.get(name) is not None:
            check_number(name, settings[name], minimum=low, maximum=high, integer=integer)


def _check_request(model, padding_side: str, max_new_tokens) -> None:
    """Refuse encoders, an unknown padding side and a non-positive token count."""
    if not model.is_decoder:
        raise UnsupportedArchitecture(
            f"{model.name} is an encoder ({model.arch.family}): it has no next-token head and cannot generate; "
            f"use model.run(...) for a forward with hooks"
        )
    if padding_side not in PADDING_SIDES:
        raise InputError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def _check_budget(model, n_prompt: int, max_new_tokens: int) -> None:
    """The prompt and the new tokens fit the model's context (at most :data:`MAX_NEW_TOKENS` new
    tokens where the context is not known): else a clear error before any forward."""
    ctx = model.max_context
    if ctx is None:
        if max_new_tokens > MAX_NEW_TOKENS:
            raise InputError(
                f"max_new_tokens={max_new_tokens} is more than {MAX_NEW_TOKENS}, the most depthscope generates for a "
                f"model whose context is not known ({model.name}); generate fewer tokens"
            )
        return
    if n_prompt + max_new_tokens > ctx:
        room = ctx - n_prompt
        fix = f"use max_new_tokens <= {room}" if room > 0 else "shorten the prompt"
        raise ContextLengthError(
            f"the prompt has {n_prompt} tokens and max_new_tokens={max_new_tokens} more would make "
            f"{n_prompt + max_new_tokens}, past {model.name}'s context of {ctx} tokens; {fix}"
        )


def _with_finite_check(given, steps: _Steps, nonfinite: dict):
    """transformers' ``logits_processor`` list: the caller's processors and the check of each
    step's logits (:class:`_FiniteLogits`)."""
    from transformers import LogitsProcessorList  # lazy: transformers' generation utilities are heavy

    return LogitsProcessorList([*(given or []), _FiniteLogits(steps, nonfinite)])


class _FiniteLogits:
    """A logits processor that raises where a step's next-token logits hold NaN or +inf, or a row
    of only -inf (greedy decoding would pick token 0, sampling would fail elsewhere); it names the
    step and the hook points whose replacement made the stream non-finite (``nonfinite``, noted
    by the engine). It returns the scores unchanged."""

    def __init__(self, steps: _Steps, nonfinite: dict):
        self.steps, self.nonfinite = steps, nonfinite

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bad = torch.isnan(scores).any() | torch.isposinf(scores).any() | torch.isneginf(scores).all(-1).any()
        if bool(bad):
            step = self.steps.state.step
            hooks = sorted(name for name, flag in self.nonfinite.items() if bool(flag))
            why = (
                f"the hook(s) at {', '.join(hooks)} returned NaN or inf where their input was finite"
                if hooks
                else "the stream became non-finite (a hook's value, or an overflow in the model's dtype)"
            )
            raise NonFiniteActivationError(
                f"generation step {step} (ctx.step == {step}): the next-token logits hold NaN or inf: {why}; "
                f"no token was generated from them"
            )
        return scores


class _Steps:
    """The generation steps as the hooks see them: before each forward of ``generate`` the step
    counter, the mask so far and the new rows' positions are updated, and the points cached by the
    previous forward are moved to ``per_step`` (name -> list over steps)."""

    def __init__(self, batch: int, device: torch.device, names: list[str]):
        self.batch, self.device = batch, device
        self.state = State(step=-1)
        self.per_step: dict[str, list] = {name: [] for name in names}
        self.engine: Engine | None = None

    def flush(self) -> None:
        if self.engine is not None:
            for k, v in self.engine.store.items():
                self.per_step[k].append(v)
            self.engine.store.clear()

    def on_forward(self, mod, args, kwargs) -> None:
        self.flush()
        if self.engine is not None and self.engine.nonfinite is not None:
            self.engine.nonfinite.clear()  # the flags of this step's forward only
        state = self.state
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
                else torch.ones(self.batch, n_new, dtype=torch.bool, device=self.device)
            )
            pos = position_ids(full)[:, -n_new:]
        state.positions = pos.expand(self.batch, -1)


def _new_tokens(model, new: torch.Tensor) -> list[torch.Tensor]:
    """Each row's new tokens up to and including its first end-of-sequence token."""
    eos = getattr(model.hf_model.generation_config, "eos_token_id", None)
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    tokens = []
    for row in new:
        stop = next((i + 1 for i, t in enumerate(row.tolist()) if t in eos), len(row))
        tokens.append(row[:stop].cpu())
    return tokens
