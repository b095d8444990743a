"""Running text of CoNLL-U files, for the analyses that read documents rather than annotations.

``depthscope run`` feeds the logit lens and contribution norms with the text of its probe data
(the bundled UD English EWT sample unless told otherwise), and sweeps default to the same text:
:func:`conllu_documents` joins a file's ``# text =`` lines into documents, :func:`sample_texts`
does it for the bundled sample.
"""

from __future__ import annotations

from pathlib import Path

from depthscope.probes import sample_data

TEXT_PREFIX = "# text = "

__all__ = ["conllu_documents", "sample_texts"]


def conllu_documents(path: str | Path, sentences_per_doc: int = 6) -> list[str]:
    """Documents of running text from a CoNLL-U file: ``# text`` lines grouped by ``# newdoc``
    (or every ``sentences_per_doc`` sentences when the file marks no documents)."""
    docs: list[list[str]] = [[]]
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith("# newdoc") and docs[-1]:
            docs.append([])
        elif line.startswith(TEXT_PREFIX):
            if len(docs[-1]) >= sentences_per_doc:
                docs.append([])
            docs[-1].append(line[len(TEXT_PREFIX) :].strip())
    return [" ".join(d) for d in docs if d]


def sample_texts() -> list[str]:
    """Running text of the bundled EWT sample (train and test parts)."""
    s = sample_data()
    return conllu_documents(s["ewt_train"]) + conllu_documents(s["ewt_test"])
