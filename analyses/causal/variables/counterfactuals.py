"""Counterfactual datasets: a base input, a source input, and what a causal model predicts once a
variable of the base takes the source's value (the data of interchange interventions and DAS).

One example per line of a JSONL file::

    {"base": "The key to the cabinets", "source": "The keys to the cabinet",
     "candidates": [" is", " are"], "label": " are", "base_label": " is", "source_label": " are",
     "variable": "number", "positions": {"SUBJ": 2, "END": -1}}

* ``base``, ``source``: the two prompts (non-empty strings);
* ``candidates``: the output tokens compared (two or more distinct single tokens: strings, mind the
  leading space, or token ids); the intervened prediction is the argmax of their logits at the
  last position;
* ``label``: the candidate the causal model predicts for the base once the variable takes the
  source's value; ``base_label`` (optional): the candidate it predicts for the base itself;
  ``source_label`` (optional): the candidate it predicts for the source itself (where the
  candidates are answers for the source too); :func:`~depthscope.analyses.causal.variables.solving.solved`
  checks the model against both;
* ``variable`` (optional): the variable's name;
* ``positions`` (optional): named positions as in patching pairs: an index into both prompts'
  tokens (the model's tokenizer; negative from the end), or ``[base index, source index]`` where
  the two differ. ``END`` (the last token of each) is always defined.

==========================  ====================================================================
:class:`Counterfactual`     one example; :meth:`Counterfactual.from_dict` checks a JSON object
:func:`read_counterfactuals`  a JSONL file, every line checked before any model loads (errors
                            name the file and the line)
:func:`as_counterfactuals`  examples from a list (of examples or dicts) or a ``.jsonl`` path
:func:`write_counterfactuals`  examples to a JSONL file (atomically)
:func:`split_examples`      a seeded train/test split
:func:`overlap`             how many test examples are also train examples (same prompts)
:class:`TokenExample`,      examples as a model sees them: token ids, candidate ids, the label's
:func:`tokenize_examples`   index, positions resolved to ``(base, source)`` indices and checked
                            against the prompts' lengths
==========================  ====================================================================
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from depthscope.common.errors import InputError
from depthscope.common.files import atomic_text
from depthscope.common.jsonl import read_jsonl

if TYPE_CHECKING:  # the reading is torch-free: the settings check a file before the model loads
    import torch

__all__ = [
    "Counterfactual",
    "read_counterfactuals",
    "as_counterfactuals",
    "write_counterfactuals",
    "split_examples",
    "overlap",
    "TokenExample",
    "tokenize_examples",
    "END",
    "MAX_EXAMPLES",
]

#: the position every example has: the last token of base and source
END = "END"
#: the most examples one file may hold (a bound on what a typed path makes depthscope read and hold)
MAX_EXAMPLES = 1_000_000
#: the most candidates of one example
MAX_CANDIDATES = 1000
_FIELDS = ("base", "source", "candidates", "label", "base_label", "source_label", "variable", "positions")
Token = str | int


def _is_token(x) -> bool:
    return (isinstance(x, str) and x != "") or (isinstance(x, int) and not isinstance(x, bool) and x >= 0)


def _check_position(name, value, where: str) -> None:
    ok_int = isinstance(value, int) and not isinstance(value, bool)
    pair = isinstance(value, (list, tuple)) and len(value) == 2
    if pair:
        pair = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if not (isinstance(name, str) and name and (ok_int or pair)):
        raise InputError(
            f"{where}: position {name!r} must be an index or [base index, source index] (integers), got {value!r}"
        )


@dataclass(frozen=True)
class Counterfactual:
    """One counterfactual example (see the module docstring); ``where`` names its origin (a file and
    line) for error messages and is not part of its value. ``source_label`` comes last so that the
    positional order of the other fields stays as it was (give it by keyword)."""

    base: str
    source: str
    candidates: tuple[Token, ...]
    label: Token
    base_label: Token | None = None
    variable: str | None = None
    positions: Mapping[str, int | Sequence[int]] | None = field(default=None, hash=False)
    where: str = field(default="", compare=False, repr=False)
    source_label: Token | None = None

    @classmethod
    def from_dict(cls, d, where: str = "an example") -> Counterfactual:
        """An example from a JSON object; every field is checked and a bad one raises
        :class:`InputError` naming ``where``."""
        if not isinstance(d, Mapping):
            raise InputError(f"{where}: expected a JSON object with fields {', '.join(_FIELDS)}, got {d!r:.60}")
        extra = sorted(set(d) - set(_FIELDS))
        if extra:
            raise InputError(f"{where}: unknown field(s) {extra}; an example has {', '.join(_FIELDS)}")
        for key in ("base", "source"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise InputError(f"{where}: {key!r} must be a non-empty string, got {d.get(key)!r:.60}")
        cands = d.get("candidates")
        if not isinstance(cands, (list, tuple)) or not 2 <= len(cands) <= MAX_CANDIDATES:
            raise InputError(f"{where}: 'candidates' must be a list of 2 to {MAX_CANDIDATES} tokens, got {cands!r:.60}")
        if not all(_is_token(c) for c in cands) or len(set(cands)) != len(cands):
            raise InputError(f"{where}: 'candidates' must be distinct tokens (strings or ids), got {cands!r:.80}")
        for key in ("label", "base_label", "source_label"):
            v = d.get(key)
            if (key == "label" or v is not None) and v not in cands:
                raise InputError(f"{where}: {key!r} must be one of the candidates {list(cands)!r}, got {v!r:.60}")
        if d.get("variable") is not None and not isinstance(d["variable"], str):
            raise InputError(f"{where}: 'variable' must be a string, got {d['variable']!r:.60}")
        pos = d.get("positions")
        if pos is not None and not isinstance(pos, Mapping):
            raise InputError(f"{where}: 'positions' must be an object of name: index, got {pos!r:.60}")
        for name, value in (pos or {}).items():
            _check_position(name, value, where)
        named = {str(k): (v if isinstance(v, int) else list(v)) for k, v in (pos or {}).items()}
        label, base_label, variable = d["label"], d.get("base_label"), d.get("variable")
        return cls(
            d["base"],
            d["source"],
            tuple(cands),
            label,
            base_label,
            variable,
            named or None,
            where,
            source_label=d.get("source_label"),
        )

    def to_dict(self) -> dict:
        """The JSON object of this example (its fields; ``where`` left out, unset fields too)."""
        d = asdict(self)
        d["candidates"] = list(self.candidates)
        return {k: d[k] for k in _FIELDS if d[k] is not None}


def read_counterfactuals(path) -> list[Counterfactual]:
    """Every example of a JSONL file (blank lines skipped), each line checked: a bad line raises
    :class:`InputError` naming the file and the line (:func:`~depthscope.common.jsonl.read_jsonl`)."""
    return read_jsonl(path, Counterfactual.from_dict, what="examples", limit=MAX_EXAMPLES)


def as_counterfactuals(obj, what: str = "examples") -> list[Counterfactual]:
    """Examples from a ``.jsonl`` path, or a non-empty list of :class:`Counterfactual` or dicts."""
    if isinstance(obj, (str, os.PathLike)):
        return read_counterfactuals(obj)
    if isinstance(obj, Counterfactual):
        return [obj]
    if not isinstance(obj, (list, tuple)) or not obj:
        raise InputError(f"{what} must be a non-empty list of examples or a .jsonl path, got {type(obj).__name__}")
    out = []
    for i, x in enumerate(obj):
        if isinstance(x, Counterfactual):
            out.append(x)
        elif isinstance(x, Mapping):
            out.append(Counterfactual.from_dict(x, f"{what}[{i}]"))
        else:
            raise InputError(f"{what}[{i}]: expected a Counterfactual or a dict, got {type(x).__name__}")
    return out


def write_counterfactuals(examples: Sequence[Counterfactual], path) -> Path:
    """Write examples as JSONL (one object per line, atomically); returns the path."""
    lines = [json.dumps(e.to_dict(), ensure_ascii=False) for e in as_counterfactuals(list(examples))]
    return atomic_text(Path(path), "\n".join(lines) + "\n")


def split_examples(examples: Sequence, train_fraction: float, seed: int = 0) -> tuple[list, list]:
    """A seeded random split into (train, test): ``round(train_fraction * n)`` examples train, at
    least one in each part."""
    n = len(examples)
    if n < 2:
        raise InputError(f"a train/test split needs at least 2 examples, got {n}")
    if not 0 < train_fraction < 1:
        raise InputError(f"the train fraction must be between 0 and 1 (exclusive), got {train_fraction}")
    k = min(max(round(train_fraction * n), 1), n - 1)
    order = np.random.default_rng(seed).permutation(n)
    return [examples[i] for i in sorted(order[:k])], [examples[i] for i in sorted(order[k:])]


def overlap(train: Sequence[Counterfactual], test: Sequence[Counterfactual]) -> int:
    """How many of ``test`` are also in ``train``: the same ``base`` and ``source`` prompts (what the
    model is run on; the labels and positions follow from them), each test example counted once.
    A test example seen in training makes held-out IIA an in-sample figure."""
    seen = {(e.base, e.source) for e in train}
    return sum((e.base, e.source) in seen for e in test)


# ----------------------------------------------------------------------------- tokenized
@dataclass(frozen=True)
class TokenExample:
    """An example as the model sees it: ``base_ids`` and ``source_ids`` (1-D, on the CPU), the
    candidates' ids, the index of ``label`` (and of ``base_label``, or -1) among them, and
    positions ``name -> (base index, source index)``, non-negative, ``END`` included."""

    index: int
    base_ids: torch.Tensor
    source_ids: torch.Tensor
    candidates: tuple[int, ...]
    label: int
    base_label: int
    positions: dict[str, tuple[int, int]]
    where: str


def _resolve(value, n_base: int, n_source: int, where: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    out = []
    for v, n, what in ((pair[0], n_base, "base"), (pair[1], n_source, "source")):
        if not -n <= v < n:
            raise InputError(f"{where}: index {v} is outside the {what} prompt's {n} tokens")
        out.append(v % n)
    return out[0], out[1]


def _ids(model, text: str, where: str) -> torch.Tensor:
    """The token ids (1-D, CPU) of one prompt, checked against the context."""
    ids, _ = model.tokenize([text])
    ctx = model.max_context
    if ctx is not None and ids.shape[1] > ctx:
        raise InputError(f"{where}: a prompt of {ids.shape[1]} tokens is longer than the context of {ctx}")
    return ids[0].cpu()


def tokenize_examples(model, examples: Sequence[Counterfactual], positions: Sequence[str] = ()) -> list[TokenExample]:
    """The examples as ``model`` sees them; each candidate must be one token, and every name of
    ``positions`` must be a position every example gives (``END`` always is)."""
    out = []
    for i, e in enumerate(examples):
        where = e.where or f"example {i}"
        b, s = _ids(model, e.base, f"{where}, base"), _ids(model, e.source, f"{where}, source")
        try:
            cands = tuple(model.token_id(c, "candidate") for c in e.candidates)
        except InputError as err:
            raise InputError(f"{where}: {err}") from None
        if len(set(cands)) != len(cands):
            raise InputError(f"{where}: two candidates {list(e.candidates)!r} are the same token")
        given = (e.positions or {}).items()
        named = {name: _resolve(v, len(b), len(s), f"{where}, position {name!r}") for name, v in given}
        named.setdefault(END, (len(b) - 1, len(s) - 1))
        missing = [p for p in positions if p not in named]
        if missing:
            raise InputError(f"{where}: no position named {missing[0]!r}; it names {sorted(named)}")
        label = e.candidates.index(e.label)
        base_label = e.candidates.index(e.base_label) if e.base_label is not None else -1
        out.append(TokenExample(i, b, s, cands, label, base_label, named, where))
    return out
