"""A learned subspace of a residual site: the directions a variable lives in (DAS), saved and loaded,
used as steering directions and scored as a probe.

>>> sub = result.subspaces["10.mlp", "SUBJ"]                 # from das(...)
>>> save_subspaces([sub], "number.safetensors"); [sub] = load_subspaces("number.safetensors")
>>> model.generate(["The keys to the cabinet"], hooks={sub.label: sub.hook(" is")})  # set the value
>>> score_subspace(model, sub, train, test)                  # a linear probe on its coordinates

=============================  ================================================================
:class:`Subspace`              ``basis`` ``[d, k]`` (orthonormal columns) at a site and position;
                               ``values``: the mean coordinates of each value of the variable
                               (the train sources', by label); :meth:`Subspace.interchange`,
                               :meth:`Subspace.coordinates`, :meth:`Subspace.hook`
:func:`save_subspaces`,        a list of subspaces in one safetensors file (the bases and values
:func:`load_subspaces`         as tensors, the rest as JSON metadata), written atomically
:func:`score_subspace`         the subspace as a probe: a logistic regression (scikit-learn) on the
                               coordinates of the base's vector, predicting the base's value
=============================  ================================================================
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from depthscope.analyses.causal.variables.counterfactuals import as_counterfactuals, tokenize_examples
from depthscope.analyses.causal.variables.swaps import site_vectors
from depthscope.common.errors import InputError
from depthscope.common.files import atomic_write

__all__ = ["Subspace", "save_subspaces", "load_subspaces", "score_subspace"]

#: positions a steering hook writes: every position, or the last one only
HOOK_POSITIONS = ("all", "last")


@dataclass
class Subspace:
    """``basis`` ``[d, k]`` with orthonormal columns at residual site ``site`` (``label``) and
    named ``position``; ``values``: value (a candidate token's text) -> mean coordinates ``[k]``;
    ``info``: how it was found (model, method, examples, IIA)."""

    site: int
    label: str
    position: str
    basis: torch.Tensor
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    @property
    def dim(self) -> int:
        return int(self.basis.shape[1])

    def coordinates(self, h: torch.Tensor) -> torch.Tensor:
        """``h @ basis``: the coordinates ``[..., k]`` of vectors ``[..., d]`` in the subspace."""
        return h.float() @ self.basis.to(h.device)

    def interchange(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``base + (source - base) R Rᵀ``: the base with the subspace's part taken from the source."""
        r = self.basis.to(base.device)
        return base + ((source.float() - base.float()) @ r) @ r.T

    def hook(self, value: str | None = None, *, coords=None, scale: float | None = None, positions: str = "all"):
        """A hook ``fn(tensor, ctx)`` for ``model.run`` / ``model.generate`` at :attr:`label` that
        sets the coordinates of every position (``positions="last"``: the last one) to those of
        ``value`` (a key of :attr:`values`) or to ``coords``; or, with ``scale``, adds ``scale``
        times the first direction (the classic steering vector)."""
        if positions not in HOOK_POSITIONS:
            raise InputError(f"positions must be one of {HOOK_POSITIONS}, got {positions!r}")
        if sum(x is not None for x in (value, coords, scale)) != 1:
            raise InputError("give exactly one of value=, coords= or scale=")
        if value is not None and value not in self.values:
            raise InputError(f"no value {value!r} recorded for this subspace; it has {sorted(self.values)}")
        target = self.values[value] if value is not None else None
        if coords is not None:
            target = torch.as_tensor(coords, dtype=torch.float32).reshape(-1)
            if target.numel() != self.dim:
                raise InputError(
                    f"coords must have {self.dim} numbers (the subspace's dimension), got {target.numel()}"
                )
        r = self.basis

        def steer(t: torch.Tensor, ctx) -> torch.Tensor:
            rows = slice(None) if positions == "all" else slice(-1, None)
            h = t[:, rows].float()
            rr = r.to(t.device)
            if scale is not None:
                new = h + scale * rr[:, 0]
            else:
                new = h + (target.to(t.device) - h @ rr) @ rr.T
            out = t.clone()
            out[:, rows] = new.to(t.dtype)
            return out

        return steer


def save_subspaces(subspaces: Sequence[Subspace], path) -> Path:
    """Write subspaces to one safetensors file (atomically); returns the path."""
    tensors, meta = {}, []
    for i, s in enumerate(subspaces):
        tensors[f"{i}.basis"] = s.basis.detach().float().cpu().contiguous()
        for j, v in enumerate(s.values.values()):
            tensors[f"{i}.value.{j}"] = v.detach().float().cpu().contiguous()
        meta.append(
            {"site": s.site, "label": s.label, "position": s.position, "values": list(s.values), "info": s.info}
        )
    header = {"depthscope": "subspaces", "subspaces": json.dumps(meta, default=str)}
    return atomic_write(Path(path), lambda tmp: save_file(tensors, tmp, metadata=header))


def load_subspaces(path) -> list[Subspace]:
    """The subspaces of a file written by :func:`save_subspaces`."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"subspaces file {str(p)!r} does not exist")
    try:
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            header = f.metadata() or {}
        tensors = load_file(str(p))
        meta = json.loads(header["subspaces"])
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"{p}: not a subspaces file written by save_subspaces ({type(e).__name__}: {e})") from None
    out = []
    for i, m in enumerate(meta):
        values = {name: tensors[f"{i}.value.{j}"] for j, name in enumerate(m["values"])}
        out.append(Subspace(m["site"], m["label"], m["position"], tensors[f"{i}.basis"], values, m["info"]))
    return out


def _features(model, sub: Subspace, examples) -> tuple[np.ndarray, np.ndarray]:
    """Coordinates ``[n, k]`` of the bases' vectors and the base's value (``base_label``) of each."""
    exs = as_counterfactuals(examples)
    if any(e.base_label is None for e in exs):
        raise InputError("scoring a subspace as a probe needs every example's base_label (the value to predict)")
    tex = tokenize_examples(model, exs, [sub.position])
    with torch.no_grad():
        base, _ = site_vectors(model, tex, [sub.site], sub.position, 32)
    y = np.array([str(e.base_label) for e in exs])
    return sub.coordinates(base[0]).cpu().numpy(), y


def score_subspace(model, sub: Subspace, train, test) -> dict:
    """The subspace as a probe: a logistic regression (scikit-learn) fitted on the coordinates of
    the train bases' vectors predicting their ``base_label``, its accuracy on the test bases
    (``accuracy``), and the majority baseline (train's most frequent value, on test)."""
    from sklearn.linear_model import LogisticRegression  # lazy: only this function needs it

    x_tr, y_tr = _features(model, sub, train)
    x_te, y_te = _features(model, sub, test)
    if len(set(y_tr)) < 2:
        raise InputError("the train examples have one base value only: a probe needs two or more")
    clf = LogisticRegression(max_iter=1000).fit(x_tr, y_tr)
    values, counts = np.unique(y_tr, return_counts=True)
    return {
        "accuracy": float((clf.predict(x_te) == y_te).mean()),
        "majority": float((y_te == values[counts.argmax()]).mean()),
        "n_train": len(y_tr),
        "n_test": len(y_te),
    }
