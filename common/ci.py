"""The convention every interval in depthscope follows: it names its n and its method, and it is
withheld below :data:`MIN_UNITS` units with a note that says why. Here (in ``common``) so that
``depthscope.probes`` and ``depthscope.analyses`` share it; :mod:`depthscope.analyses.intervals`
re-exports it beside the cluster intervals.

=================================  ==============================================================
:data:`MIN_UNITS`                  10: the fewest units (pairs, documents, examples) an interval
                                   is given for
``provenance(n, unit, method)``    the ``ci_n``, ``ci_unit``, ``ci_method`` columns
``too_few(n)``                     whether an interval over ``n`` units is withheld (NaN)
``too_few_note(n, unit, what)``    the sentence that says why
``add_notes(df, notes)``           append sentences to ``df.attrs["notes"]``
=================================  ==============================================================
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["MIN_UNITS", "add_notes", "provenance", "too_few", "too_few_note"]

#: the fewest independent units (pairs, documents, examples) an interval is reported for: below it a
#: percentile bootstrap or a t interval is not trustworthy, so the interval columns are NaN and the
#: table's notes say why (a method valid at smaller n may be used instead, named in ``ci_method``)
MIN_UNITS = 10


def provenance(n, unit: str, method: str) -> dict:
    """The columns every table with an interval carries beside it: ``ci_n`` (how many ``unit`` the
    interval resamples or clusters over), ``ci_unit`` (``"pairs"``, ``"documents"``, ``"examples"``...)
    and ``ci_method`` (e.g. ``"percentile bootstrap over pairs, 1000 resamples"``)."""
    return {"ci_n": n, "ci_unit": unit, "ci_method": method}


def too_few(n, min_units: int = MIN_UNITS) -> np.ndarray | bool:
    """Whether an interval over ``n`` units is withheld (NaN): fewer than ``min_units``."""
    return np.asarray(n) < min_units if np.ndim(n) else int(n) < min_units


def too_few_note(n: int, unit: str, what: str = "the interval", min_units: int = MIN_UNITS) -> str:
    """The table note that says why an interval is NaN."""
    return (
        f"{what} is not given (NaN): it rests on {n} {unit}, fewer than {min_units}; with so few "
        f"{unit} a bootstrap or t interval would understate the uncertainty"
    )


def add_notes(df, notes: Sequence[str]) -> None:
    """Append ``notes`` to ``df.attrs["notes"]``: a list of sentences (a table that already carries
    its notes as one string keeps them so, joined by "; ")."""
    if not notes:
        return
    cur = df.attrs.get("notes")
    if isinstance(cur, str):
        df.attrs["notes"] = "; ".join(n for n in (cur, *notes) if n)
    else:
        df.attrs["notes"] = [*(cur or []), *notes]
