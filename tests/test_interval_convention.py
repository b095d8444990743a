"""The convention every interval follows (analyses/intervals.py): it names its n, unit and method,
and is withheld below MIN_UNITS units with a note that says why."""

from __future__ import annotations

import numpy as np

from depthscope.analyses.intervals import MIN_UNITS, provenance, too_few, too_few_note


def test_provenance_columns_and_the_floor():
    assert provenance(12, "pairs", "percentile bootstrap over pairs") == {
        "ci_n": 12,
        "ci_unit": "pairs",
        "ci_method": "percentile bootstrap over pairs",
    }
    assert MIN_UNITS == 10
    assert too_few(9) and not too_few(10)
    np.testing.assert_array_equal(too_few(np.array([3, 10, 40])), [True, False, False])
    note = too_few_note(4, "pairs", "fraction_low/fraction_high")
    assert "4 pairs" in note and "fewer than 10" in note and note.startswith("fraction_low/fraction_high")
