"""Text input of the dataset-level analyses: plain text and the sentences of CoNLL-U files."""

from __future__ import annotations

import pytest

from depthscope.analyses.text import read_documents
from depthscope.common.errors import InputError
from depthscope.probes import sample_data


def test_conllu_files_give_their_sentences_as_documents():
    path = sample_data()["ewt_test"]
    lines = path.read_text(encoding="utf-8").splitlines()
    want = [ln[len("# text = ") :].strip() for ln in lines if ln.startswith("# text = ")]
    docs = read_documents(path)
    assert docs == [w for w in want if w] and len(docs) == 153
    assert not any("\t" in d for d in docs)  # no token rows
    (whole,) = read_documents(path, per_line=False)
    assert whole.splitlines()[0] == docs[0] and whole.count("\n") == len(docs) - 1


def test_plain_text_and_an_empty_conllu(tmp_path):
    plain = tmp_path / "a.txt"
    plain.write_text("one\n\n two \n", encoding="utf-8")
    assert read_documents(plain) == ["one", "two"]
    empty = tmp_path / "b.conllu"
    empty.write_text("1\tword\tword\tNOUN\t_\t_\t0\troot\t_\t_\n", encoding="utf-8")
    with pytest.raises(InputError, match="holds no text"):
        read_documents(empty)
