"""A task ready for probes: labels as class indices, control labels, standardised features.

=====================================  =========================================================
``encode_task(task, examples,          a :class:`TaskData`: examples whose spans are covered,
extractions, seed=, resident_bytes=,   labels as indices (test labels unseen in train get
dtype=, stream=)``                     indices >= ``n_classes``), control labels, and per split
                                       :class:`Features` standardised with train's statistics
                                       and held in memory when they fit (``stream``: splits
                                       read from the store instead)
=====================================  =========================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from depthscope.common.errors import InputError
from depthscope.probes.corpora.tasks import control_labels
from depthscope.probes.store.activations import ATTN_MAX_TOKENS
from depthscope.probes.store.extraction import span_ids
from depthscope.probes.store.features import Features


@dataclass
class TaskData:
    """A task ready for probes: labels as class indices (``y``; test labels unseen in train get
    indices >= ``n_classes``), control labels (``ctrl``) and standardised :class:`Features` per
    split, plus the examples and counts of skipped spans."""

    task: str
    classes: list
    n_eval_classes: int
    y: dict
    ctrl: dict
    feats: dict
    examples: dict
    skipped: dict
    counts: np.ndarray

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    @property
    def majority_accuracy(self) -> float:
        """Test accuracy of always answering train's most frequent class."""
        return float((self.y["test"] == int(np.argmax(self.counts))).mean())


def _covered(task, ex_by_split, ext_by_split) -> tuple:
    data, skipped = {}, {}
    for split, ex in ex_by_split.items():
        ids, ok = span_ids(ex, ext_by_split[split])
        skipped[split] = int((~ok).sum())
        sub = ex.subset(ok)
        if len(sub) == 0:
            raise InputError(
                f"task {task!r}: no {split} examples left: all {len(ex)} spans are uncovered by subwords "
                f"(text longer than max_tokens, or a tokenizer without offsets)"
            )
        data[split] = (sub, ids[ok])
    return data, skipped


def _encode_labels(data: dict, classes: list) -> dict:
    """Class indices per split; labels train never has get indices ``len(classes)`` up."""
    index = {c: i for i, c in enumerate(classes)}
    unseen: dict = {}
    y = {}
    for split, (ex, _) in data.items():
        out = np.empty(len(ex.labels), dtype=np.int64)
        for i, lab in enumerate(ex.labels):
            j = index.get(lab)
            if j is None:
                if split == "train":
                    raise AssertionError(lab)
                j = unseen.setdefault(lab, len(classes) + len(unseen))
            out[i] = j
        y[split] = out
    return y


def encode_task(
    task, ex_by_split, ext_by_split, *, seed: int = 0, resident_bytes: float = 4e9, dtype=None, device=None, stream=()
) -> TaskData:
    """Covered examples, encoded labels, control labels and features of one task (``dtype``:
    the resident features' precision, None: float32; ``device``: where they are held, None: the
    CPU). The splits named in ``stream`` are not
    held in memory (read from the store when used: test, which only the final predictions
    read); the stores' pages are released once the others are copied in (they would count
    twice)."""
    data, skipped = _covered(task, ex_by_split, ext_by_split)
    classes = sorted(set(data["train"][0].labels.tolist()))
    if len(classes) < 2:
        raise InputError(f"task {task!r}: train has a single label ({classes[0]!r}); nothing to probe")
    C = len(classes)
    y = _encode_labels(data, classes)
    n_eval = max(C, max(int(v.max()) + 1 if len(v) else 0 for v in y.values()))
    counts = np.bincount(y["train"], minlength=C).astype(np.float64)
    probs = counts / counts.sum()
    ctrl = {s: control_labels(d[0].keys, classes, probs, seed=seed) for s, d in data.items()}

    max_len = ATTN_MAX_TOKENS if ext_by_split["train"].store.pooling == "attn" else 1
    feats = {s: Features(ext_by_split[s].store, ids, max_len=max_len) for s, (ex, ids) in data.items()}
    feats["train"].fit_standardiser()
    for s in feats:
        if s != "train":
            feats[s].standardise_like(feats["train"])
        if s not in stream:
            feats[s].make_resident(max_bytes=resident_bytes, seed=seed, dtype=dtype, device=device)
        feats[s].store.release()
    return TaskData(task, classes, n_eval, y, ctrl, feats, {k: v[0] for k, v in data.items()}, skipped, counts)
