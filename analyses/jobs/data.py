"""The bundled probing samples (UD English EWT and GUM excerpts): their names and paths, sentence
and word counts, licences, and copies into a folder (``depthscope data``).

======================  =====================================================================
:func:`samples`         the samples by name, absolute paths
:func:`resolve`         one sample's (name, path); an unknown name lists the valid ones
:func:`count`           sentences and syntactic words of a CoNLL-U file
:func:`copy_samples`    the named samples and their README copied into a folder
:func:`samples_table`   the console table of the samples
:func:`generate`        a generated counterfactual dataset (:data:`GENERATED`: subject-verb
                        agreement, IOI; :mod:`depthscope.analyses.causal.variables.templates`) for a
                        model's tokenizer, written as JSONL
======================  =====================================================================
"""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path

from rich.table import Table

from depthscope.common.errors import InputError, OutputError
from depthscope.common.files import atomic_write, check_writable
from depthscope.probes import sample_data

#: licence short names per treebank (the full attribution: probes/data/README.md)
LICENCES = {"ewt": "CC BY-SA 4.0", "gum": "CC BY-NC-SA 4.0"}
TREEBANKS = {"ewt": "UD English EWT", "gum": "UD English GUM"}
#: the generated counterfactual datasets (``depthscope data agreement``), by name
GENERATED = ("agreement", "ioi")


def samples() -> dict[str, Path]:
    """The bundled samples by name (``ewt_train``, ``ewt_test``, ``gum_train``, ``gum_test``),
    absolute paths."""
    return {name: Path(p).resolve() for name, p in sample_data().items()}


def resolve(name: str) -> tuple[str, Path]:
    """(name, path) of one sample; ``ewt-train`` is read as ``ewt_train``. An unknown name is an
    :class:`~depthscope.common.errors.InputError` listing the valid ones."""
    found = samples()
    key = name.strip().lower().replace("-", "_")
    if key not in found:
        raise InputError(f"no bundled sample named {name!r}; the samples are: {', '.join(found)}")
    return key, found[key]


def count(path: Path) -> tuple[int, int]:
    """(sentences, syntactic words) of a CoNLL-U file: sentences are blank-line separated blocks
    with at least one word line; words are lines whose ID is an integer (multiword-token ranges
    ``2-3`` and empty nodes ``8.1`` are not words)."""
    sentences = words = 0
    in_sentence = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                in_sentence = False
                continue
            if line.startswith("#"):
                continue
            if line.split("\t", 1)[0].isdigit():
                words += 1
                if not in_sentence:
                    sentences += 1
                    in_sentence = True
    return sentences, words


def licence(name: str) -> str:
    """The licence of a sample (by its treebank)."""
    return LICENCES.get(name.split("_", 1)[0], "see README.md")


def copy_samples(names: list[str], folder: Path, *, force: bool = False) -> list[Path]:
    """Copy the named samples, and the README that holds their attribution and licences, into
    ``folder`` (created); returns the copies of the samples. A file there with other content is
    kept unless ``force``."""
    try:
        check_writable(folder)
    except OutputError as e:
        raise OutputError(str(e).replace("--out", "--copy")) from None
    found = samples()
    sources = [found[n] for n in names]
    readme = found[names[0]].parent / "README.md"
    if readme.is_file():
        sources.append(readme)
    for src in sources:
        dest = folder / src.name
        if dest.exists() and not force and not (dest.is_file() and filecmp.cmp(src, dest, shallow=False)):
            raise OutputError(
                f"{dest} exists and is not the bundled {src.name}; use --force to overwrite it or another --copy"
            )
    copies = []
    for src in sources:
        dest = folder / src.name
        if not (dest.is_file() and filecmp.cmp(src, dest, shallow=False)):
            atomic_write(dest, lambda tmp, src=src: shutil.copyfile(src, tmp))
        copies.append(dest.resolve())
    return copies[: len(names)]


def samples_table(found: dict[str, Path]) -> Table:
    """The samples' table: name, sentences, words, path, licence."""
    t = Table("name", "sentences", "words", "path", "licence", title="bundled probing samples (UD v2.16 excerpts)")
    for name, path in found.items():
        sentences, words = count(path)
        t.add_row(name, str(sentences), str(words), str(path), licence(name))
    return t


def generate(name: str, model: str | None = None, folder: Path | None = None, *, force: bool = False) -> Path:
    """Write the generated dataset ``name`` (one of :data:`GENERATED`, default size and seed) for the
    tokenizer of ``model`` (a spec; None: the default model) as ``<folder>/<name>.jsonl`` (default
    folder: ``<cache>/datasets/<model name>``); returns its path. A file there with other content
    is kept unless ``force``."""
    import re

    from depthscope.analyses.causal.variables.counterfactuals import write_counterfactuals  # lazy: --help stays light
    from depthscope.analyses.causal.variables.templates import GENERATED as MAKERS
    from depthscope.hooks import cache_dir, load_model

    if name not in GENERATED:
        raise InputError(f"--model picks the tokenizer of a generated set ({', '.join(GENERATED)}), not of {name!r}")
    m = load_model(model)
    where = Path(folder) if folder is not None else cache_dir() / "datasets" / re.sub(r"[^\w.-]+", "_", m.name)
    try:
        check_writable(where)
    except OutputError as e:
        raise OutputError(str(e).replace("--out", "--copy")) from None
    dest = where / f"{name}.jsonl"
    tmp = where / f".{name}.jsonl.new"
    write_counterfactuals(MAKERS[name](m), tmp)
    if dest.exists() and not force and not filecmp.cmp(tmp, dest, shallow=False):
        tmp.unlink()
        raise OutputError(f"{dest} exists with other content; use --force to overwrite it or another --copy")
    tmp.replace(dest)
    return dest.resolve()
