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


def test_notes_are_appended_as_sentences_or_to_a_string():
    import pandas as pd

    from depthscope.analyses.intervals import add_notes

    df = pd.DataFrame({"a": [1]})
    add_notes(df, [])
    assert "notes" not in df.attrs
    add_notes(df, ["first"])
    add_notes(df, ["second"])
    assert df.attrs["notes"] == ["first", "second"]
    old = pd.DataFrame({"a": [1]})
    old.attrs["notes"] = "a table's own note"  # tables that carry one string keep it so
    add_notes(old, ["an interval note"])
    assert old.attrs["notes"] == "a table's own note; an interval note"


def test_cluster_provenance_names_documents_or_windows_and_withholds_below_ten():
    from depthscope.analyses.intervals import ClusterSums, cluster_provenance, interval_columns

    def sums(keys):
        c = ClusterSums()
        c.add(keys, {"v": (np.ones((len(keys), 1)), np.ones((len(keys), 1)))})
        return c

    ci, notes = cluster_provenance(sums(list(range(12))), sums([(k, 0) for k in range(12)]), "the interval")
    assert ci["ci_n"] == 12 and ci["ci_unit"] == "documents" and "CR1" in ci["ci_method"] and notes == []
    ci, notes = cluster_provenance(sums([0] * 4), sums([(0, w) for w in range(4)]), "the interval")
    assert ci["ci_n"] == 4 and ci["ci_unit"] == "windows of one document"
    assert notes == [too_few_note(4, "windows of one document", "the interval")]
    cols = interval_columns([1.0, 1.0], [0.1, 0.1], [9, 10])
    assert np.isnan(cols["lo"][0]) and np.isnan(cols["hi"][0]) and cols["se"][0] == 0.1  # SE kept, interval not
    assert cols["lo"][1] < 1.0 < cols["hi"][1]
