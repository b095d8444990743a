"""Two generated counterfactual datasets (``depthscope data agreement``, ``depthscope data ioi``).

* **Subject-verb number agreement with attractors** (Linzen et al. 2016; Finlayson et al. 2021):
  ``"The key to the cabinets"`` -> ``" is"`` / ``" are"``. The attractor (the noun between subject
  and verb) has its own number, independent of the subject's. The variable is the subject's
  number; the source is another sentence of the same template (another noun, another attractor)
  whose subject has the other number, so ``label`` is the verb of the source's number and
  ``base_label`` the verb of the base's; ``source_label``, the source's own verb, equals
  ``label``. Positions: ``SUBJ`` (the subject noun's last token in base and source) and ``END``.
* **Indirect object identification** (Wang et al. 2022): ``"When Mary and John went to the store,
  John gave a drink to"`` -> ``" Mary"``. The variable is which of the two names introduced first
  is the indirect object: the first (``"BAB"`` patterns, ``A and B ..., B gave``) or the second.
  The source is another sentence (other names, place and object) with the other pattern, so
  ``label`` is the base's name at the role the source's indirect object has. Candidates: the
  base's two names; ``source_label`` is left unset, since the source's own indirect object is one
  of its own names, not a candidate. Positions: ``S2`` (the repeated name) and ``END``.

Positions are token indices, so a dataset is made for one tokenizer (the model's): nouns and
names that it does not encode as single tokens are still used (the last token of a noun is its
position) except as candidates, which must be single tokens.

=============================  ================================================================
:func:`agreement_examples`     ``n`` agreement examples for a tokenizer, seeded
:func:`ioi_examples`           ``n`` IOI examples for a tokenizer, seeded
:data:`GENERATED`              name -> generator (what ``depthscope data`` offers)
=============================  ================================================================
"""

from __future__ import annotations

import numpy as np

from depthscope.analyses.causal.variables.counterfactuals import Counterfactual
from depthscope.common.errors import InputError

__all__ = ["agreement_examples", "ioi_examples", "GENERATED"]

#: (singular, plural) nouns of the agreement templates
NOUNS = [
    ("key", "keys"),
    ("author", "authors"),
    ("cabinet", "cabinets"),
    ("book", "books"),
    ("teacher", "teachers"),
    ("student", "students"),
    ("doctor", "doctors"),
    ("manager", "managers"),
    ("picture", "pictures"),
    ("building", "buildings"),
    ("letter", "letters"),
    ("window", "windows"),
    ("farmer", "farmers"),
    ("officer", "officers"),
    ("singer", "singers"),
    ("lawyer", "lawyers"),
    ("report", "reports"),
    ("friend", "friends"),
    ("table", "tables"),
    ("painting", "paintings"),
]
#: agreement templates: (text with {s} the subject and {a} the attractor, (singular verb, plural verb))
AGREEMENT = [
    ("The {s} near the {a}", (" is", " are")),
    ("The {s} behind the {a}", (" was", " were")),
    ("The {s} of the {a}", (" is", " are")),
    ("The {s} with the {a}", (" was", " were")),
    ("The {s} that the {a} saw", (" is", " are")),
    ("The {s} that the {a} liked", (" was", " were")),
]
NAMES = [" Mary", " John", " Anna", " David", " Sarah", " James", " Emma", " Robert", " Laura", " Thomas"]
PLACES = ["store", "park", "school", "office", "beach", "station"]
OBJECTS = ["drink", "book", "ball", "letter", "gift", "key"]
#: IOI templates: {a} and {b} the names in order, {s} the repeated name, {p} a place, {o} an object
IOI = [
    "When{a} and{b} went to the {p},{s} gave a {o} to",
    "After{a} and{b} arrived at the {p},{s} handed a {o} to",
    "Then{a} and{b} had lunch at the {p}, and{s} passed a {o} to",
]


def _tokenizer(model_or_tokenizer):
    tok = getattr(model_or_tokenizer, "tokenizer", model_or_tokenizer)
    if tok is None or not callable(tok):
        raise InputError("a generated dataset needs the model's tokenizer (its positions are token indices)")
    return tok


def _token_at(tok, text: str, char_end: int) -> int:
    """The index of the token holding character ``char_end - 1`` of ``text``, as the model tokenizes
    it (special tokens included)."""
    enc = tok(text, add_special_tokens=True, return_offsets_mapping=True)
    for i, (a, b) in enumerate(enc["offset_mapping"]):
        if a < char_end <= b and b > a:
            return i
    raise InputError(f"no token of {text!r} ends at character {char_end}")


def _single(tok, token: str) -> bool:
    return len(tok(token, add_special_tokens=False)["input_ids"]) == 1


def _agreement_sentence(rng, template: str, plural: bool) -> tuple[str, int]:
    """(text, end of the subject noun in characters) of one sentence with a subject of ``plural``
    number and an attractor of a random number."""
    s, a = NOUNS[rng.integers(len(NOUNS))], NOUNS[rng.integers(len(NOUNS))]
    subject, attractor = s[int(plural)], a[int(rng.integers(2))]
    head = template.split("{s}")[0]
    return template.format(s=subject, a=attractor), len(head) + len(subject)


def agreement_examples(model_or_tokenizer, n: int = 400, seed: int = 0) -> list[Counterfactual]:
    """``n`` subject-verb agreement examples (see the module docstring) for a model's tokenizer."""
    tok = _tokenizer(model_or_tokenizer)
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        template, verbs = AGREEMENT[k % len(AGREEMENT)]
        if not all(_single(tok, v) for v in verbs):
            raise InputError(f"the verbs {verbs} are not single tokens of this tokenizer")
        plural = bool(rng.integers(2))
        base, b_end = _agreement_sentence(rng, template, plural)
        source, s_end = _agreement_sentence(rng, template, not plural)
        subj = [_token_at(tok, base, b_end), _token_at(tok, source, s_end)]
        out.append(
            Counterfactual(
                base,
                source,
                verbs,
                verbs[int(not plural)],
                verbs[int(plural)],
                "subject number",
                {"SUBJ": subj, "END": -1},
                source_label=verbs[int(not plural)],  # the source's own number: the label
            )
        )
    return out


def _ioi_sentence(rng, template: str, names: list[str], io_first: bool) -> tuple[str, list[str], int]:
    """(text, [first name, second name], character end of the repeated name)."""
    a, b = (names[i] for i in rng.choice(len(names), 2, replace=False))
    s = b if io_first else a  # the subject repeats; the other name is the indirect object
    place, obj = PLACES[rng.integers(len(PLACES))], OBJECTS[rng.integers(len(OBJECTS))]
    text = template.format(a=a, b=b, s=s, p=place, o=obj)
    head = template.split("{s}")[0].format(a=a, b=b, p=place)
    return text, [a, b], len(head) + len(s)


def ioi_examples(model_or_tokenizer, n: int = 200, seed: int = 0) -> list[Counterfactual]:
    """``n`` IOI examples (see the module docstring) for a model's tokenizer; the names are those of
    :data:`NAMES` that it encodes as single tokens (at least two)."""
    tok = _tokenizer(model_or_tokenizer)
    names = [x for x in NAMES if _single(tok, x)]
    if len(names) < 2:
        raise InputError(f"fewer than two of the names {NAMES} are single tokens of this tokenizer")
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        template = IOI[k % len(IOI)]
        io_first = bool(rng.integers(2))
        base, (a, b), b_end = _ioi_sentence(rng, template, names, io_first)
        source, _, s_end = _ioi_sentence(rng, template, names, not io_first)
        io_base, io_moved = (a, b) if io_first else (b, a)  # the base's IO, and the name at the source's IO role
        s2 = [_token_at(tok, base, b_end), _token_at(tok, source, s_end)]
        out.append(Counterfactual(base, source, (a, b), io_moved, io_base, "indirect object", {"S2": s2, "END": -1}))
    return out


#: the datasets ``depthscope data`` generates, by name
GENERATED = {"agreement": agreement_examples, "ioi": ioi_examples}
