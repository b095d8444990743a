"""Prompts and metrics of patching: token ids of a prompt, the metric of a pair, a pair as a model sees it.

=========================  =====================================================================
offers                     what
=========================  =====================================================================
TokenMetric                a metric of the last position's logits: ``logit_diff`` (target minus
                           foil), ``logit``, ``prob``, ``logprob`` of a target token
logit_diff, logit,         its constructors
prob, logprob
bind_metric                ``fn(logits [batch, pos, vocab]) -> [batch]`` and a description from a
                           ``(target, foil)`` pair, a TokenMetric or any function of the logits
last_position              mark a metric function as reading the last position only (so patching
                           may hand it the logits of the recomputed positions only)
reads_last_position        whether a metric reads the last position only: the token metrics, and
                           functions marked by :func:`last_position`
prompt_ids                 token ids ``[1, pos]`` of one prompt (a string or token ids), checked
                           against the vocabulary and the context
TokenPair                  a :class:`~depthscope.analyses.circuits.pairs.PromptPair` as the model sees it
tokenize_pairs             TokenPairs of a model: a metric per pair (its own target and foil, or
                           the metric given), named positions as indices checked against lengths
describe_metrics           one description of the metrics of a dataset of TokenPairs
pair_fraction              one pair's fraction recovered of patched values (NaN for no gap)
token_texts                ``p -> token text`` of one prompt's ids (cached per position)
=========================  =====================================================================
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from depthscope.analyses.circuits.pairs import PromptPair
from depthscope.common.errors import InputError

__all__ = [
    "TokenMetric",
    "logit_diff",
    "logit",
    "prob",
    "logprob",
    "bind_metric",
    "last_position",
    "reads_last_position",
    "prompt_ids",
    "TokenPair",
    "tokenize_pairs",
    "describe_metrics",
    "pair_fraction",
    "token_texts",
]

Prompt = str | torch.Tensor | Sequence[int]


# ----------------------------------------------------------------------------- metrics
@dataclass(frozen=True)
class TokenMetric:
    """A metric of the logits at the last position: ``kind`` is ``logit_diff`` (target minus
    foil), ``logit``, ``prob`` or ``logprob`` of ``target``. Tokens are single-token strings
    (mind the leading space: ``" Mary"``) or token ids; :meth:`bind` resolves them for a model."""

    kind: str
    target: str | int
    foil: str | int | None = None

    def bind(self, model) -> Callable[[torch.Tensor], torch.Tensor]:
        t = _single_token(model, self.target, "target")
        f = _single_token(model, self.foil, "foil") if self.kind == "logit_diff" else None
        kind = self.kind

        def metric(logits: torch.Tensor) -> torch.Tensor:
            last = logits[:, -1].float()
            if kind == "logit_diff":
                return last[:, t] - last[:, f]
            if kind == "logit":
                return last[:, t]
            lp = torch.log_softmax(last, dim=-1)[:, t]
            return lp if kind == "logprob" else lp.exp()

        return metric

    def describe(self) -> str:
        if self.kind == "logit_diff":
            return f"logit[{self.target!r}] - logit[{self.foil!r}]"
        return f"{self.kind}[{self.target!r}]"


def logit_diff(target, foil) -> TokenMetric:
    """``logit[target] - logit[foil]`` at the last position."""
    return TokenMetric("logit_diff", target, foil)


def logit(target) -> TokenMetric:
    """``logit[target]`` at the last position."""
    return TokenMetric("logit", target)


def prob(target) -> TokenMetric:
    """Probability of ``target`` at the last position."""
    return TokenMetric("prob", target)


def logprob(target) -> TokenMetric:
    """Log-probability of ``target`` at the last position."""
    return TokenMetric("logprob", target)


def _single_token(model, token, what: str) -> int:
    if token is None:
        raise InputError(f"a logit difference needs a {what} token")
    return model.token_id(token, what)


#: the attribute that marks a metric function as reading the logits' last position only
LAST_POSITION = "reads_last_position"


def last_position(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn``, marked as reading the last position of its logits only (``logits[:, -1]``): patching
    with a shared key/value prefix may then pass it the logits of the recomputed positions only,
    which is faster; an unmarked function gets the logits of every position. Returns ``fn``."""
    if not callable(fn):
        raise InputError(f"last_position marks a metric function, got {type(fn).__name__}")
    try:
        setattr(fn, LAST_POSITION, True)
    except (AttributeError, TypeError):
        raise InputError(f"cannot mark {fn!r} (it takes no attributes); wrap it in a def") from None
    return fn


def reads_last_position(metric) -> bool:
    """Whether a metric reads the last position only: a ``(target, foil)`` pair or a
    :class:`TokenMetric` does, a function only when marked by :func:`last_position`."""
    if isinstance(metric, TokenMetric) or (isinstance(metric, tuple) and len(metric) == 2):
        return True
    return getattr(metric, LAST_POSITION, False) is True


def bind_metric(model, metric) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """(fn(logits [batch, pos, vocab]) -> [batch], description) from any accepted metric."""
    if isinstance(metric, tuple) and len(metric) == 2:
        metric = logit_diff(*metric)
    if isinstance(metric, TokenMetric):
        if metric.kind not in ("logit_diff", "logit", "prob", "logprob"):
            raise InputError(f"unknown metric kind {metric.kind!r}: use logit_diff, logit, prob or logprob")
        return metric.bind(model), metric.describe()
    if callable(metric):
        name = getattr(metric, "__name__", type(metric).__name__)

        def checked(logits: torch.Tensor) -> torch.Tensor:
            got = metric(logits)
            try:
                out = torch.as_tensor(got)
            except (TypeError, ValueError, RuntimeError):
                raise InputError(
                    f"metric {name} returned {type(got).__name__}; it must return numbers, one per batch row"
                ) from None
            if not (out.is_floating_point() or out.dtype in (torch.int32, torch.int64)):
                raise InputError(f"metric {name} returned {out.dtype} values; it must return numbers")
            if out.dim() == 0 and logits.shape[0] == 1:
                out = out.reshape(1)
            if out.shape != (logits.shape[0],):
                raise InputError(
                    f"metric {name} returned shape {tuple(out.shape)}; it must return one "
                    f"number per batch row, shape ({logits.shape[0]},)"
                )
            return out.float()

        return checked, name
    raise InputError(
        f"metric must be a (target, foil) pair, a TokenMetric (logit_diff, prob, ...) or a "
        f"function of the logits, got {type(metric).__name__}"
    )


# ----------------------------------------------------------------------------- prompts
def prompt_ids(model, prompt: Prompt, what: str) -> torch.Tensor:
    """Token ids ``[1, pos]`` of one prompt (a string, or token ids)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InputError(f"the {what} prompt is empty")
        ids, _ = model.tokenize([prompt])
    else:
        t = torch.as_tensor(prompt)
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1 or t.numel() == 0 or t.dtype in (torch.float16, torch.float32, torch.float64, torch.bool):
            raise InputError(
                f"the {what} prompt must be a string or one sequence of token ids, got shape {tuple(t.shape)} {t.dtype}"
            )
        ids = t.long()[None]
        if int(ids.min()) < 0 or int(ids.max()) >= model.vocab_size:
            raise InputError(f"the {what} prompt has token ids out of range 0..{model.vocab_size - 1}")
    ctx = model.max_context
    if ctx is not None and ids.shape[1] > ctx:
        raise InputError(f"the {what} prompt has {ids.shape[1]} tokens, more than the context of {ctx}")
    return ids.to(model.device)


@dataclass(frozen=True)
class TokenPair:
    """A pair as the model sees it: ids ``[1, pos]`` on the model's device, the metric
    ``fn(logits [batch, pos, vocab]) -> [batch]`` and its description, named positions as
    ``name -> (clean index, corrupted index)`` (non-negative), its index in the dataset, whether
    the metric reads the last position only (:func:`reads_last_position`) and where the pair
    comes from in messages (``pair 3`` or ``pair 3 (pairs.jsonl:5)``)."""

    index: int
    clean_ids: torch.Tensor
    corrupted_ids: torch.Tensor
    metric: Callable[[torch.Tensor], torch.Tensor]
    what: str
    positions: dict[str, tuple[int, int]] | None = None
    last_only: bool = True
    where: str = ""

    def flipped(self) -> TokenPair:
        """The pair with its prompts exchanged (clean <-> corrupted, named positions too): patching
        the flipped pair's clean values into its corrupted run patches this pair's corrupted values
        into its clean run (the ``noise`` direction)."""
        named = {n: (k, c) for n, (c, k) in self.positions.items()} if self.positions else self.positions
        return replace(self, clean_ids=self.corrupted_ids, corrupted_ids=self.clean_ids, positions=named)


def _index(value, n_clean: int, n_corrupted: int, where: str) -> tuple[int, int]:
    """(clean, corrupted) indices of one named position, checked against the lengths."""
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise InputError(f"{where}: a position is an index or [clean index, corrupted index], got {value!r}")
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
        raise InputError(f"{where}: a position is an index or [clean index, corrupted index], got {value!r}")
    out = []
    for v, n, what in ((pair[0], n_clean, "clean"), (pair[1], n_corrupted, "corrupted")):
        if not -n <= v < n:
            raise InputError(f"{where}: index {v} is outside the {what} prompt's {n} tokens")
        out.append(v % n)
    return out[0], out[1]


def tokenize_pairs(model, pairs: Sequence[PromptPair], metric=None) -> list[TokenPair]:
    """Token ids, metric and positions of each pair. A pair's own ``target`` (and ``foil``)
    make its metric; pairs without a target use ``metric`` (any metric patching accepts), and
    it is an error when neither is there. Errors name the pair (its index, and its file and line
    when it was read from one)."""
    shared = bind_metric(model, metric) if metric is not None else None
    out = []
    for i, p in enumerate(pairs):
        where = f"pair {i}" + (f" ({p.where})" if getattr(p, "where", None) else "")
        c, k = prompt_ids(model, p.clean, f"clean ({where})"), prompt_ids(model, p.corrupted, f"corrupted ({where})")
        if p.target is not None:
            fn, what = bind_metric(model, logit_diff(p.target, p.foil) if p.foil is not None else logprob(p.target))
            last = True
        elif shared is not None:
            (fn, what), last = shared, reads_last_position(metric)
        else:
            raise InputError(f"{where} has no target token and no metric was given")
        named = None
        if p.positions:
            named = {
                str(n): _index(v, c.shape[1], k.shape[1], f"{where}, position {n!r}") for n, v in p.positions.items()
            }
        out.append(TokenPair(i, c, k, fn, what, named, last, where))
    return out


def describe_metrics(tps: Sequence[TokenPair]) -> str:
    """The metric of a dataset: the pairs' own description when they share one, else a summary."""
    whats = list(dict.fromkeys(tp.what for tp in tps))
    if len(whats) == 1:
        return whats[0]
    return "logit[target] - logit[foil] of each pair" if all(" - " in w for w in whats) else "each pair's metric"


def pair_fraction(tp: TokenPair, clean_value: float, corrupted_value: float, values):
    """``(values - corrupted) / (clean - corrupted)`` for one pair; NaN when the prompts are equal
    or the gap is at the level of float rounding (the clean and patched runs are different
    forwards: the fraction would be noise)."""
    denom = clean_value - corrupted_value
    scale = max(1.0, abs(clean_value), abs(corrupted_value))
    if torch.equal(tp.clean_ids.cpu(), tp.corrupted_ids.cpu()) or abs(denom) <= 1e-6 * scale:
        return float("nan")
    return (values - corrupted_value) / denom


def token_texts(model, ids: torch.Tensor) -> Callable[[int | None], str]:
    """``p -> token text`` at position ``p`` of ``ids`` ``[1, pos]`` ("" for None: every position),
    cached: many patches share a position."""

    @functools.cache
    def text(p: int | None) -> str:
        if p is None:
            return ""
        i = int(ids[0, p])
        return model.tokenizer.decode([i]) if model.tokenizer is not None else str(i)

    return text
