"""Probing data: CoNLL-U parsing (multiword tokens, empty nodes, GUM entities), bad input with
file and line, tasks, control labels, jiant JSONL, span -> subword mapping."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from depthscope.common.errors import InputError
from depthscope.probes import (
    ConlluError,
    build_task,
    control_labels,
    parse_conllu_text,
    read_conllu,
    read_jiant,
    sample_data,
)
from depthscope.probes.corpora.spans import SpanTable, build_passages, map_spans, span_tokens, tokenize_passages

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

UD = os.path.join(FIXTURES, "ud")

HANDMADE = """# newdoc id = d1
# global.Entity = GRP-etype-infstat
# sent_id = s1
# text = I don't know del Eye-Tracking
1\tI\tI\tPRON\tPRP\tCase=Nom|Number=Sing\t4\tnsubj\t_\tEntity=(1-person-new)
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\tdo\tAUX\tVBP\tMood=Ind\t4\taux\t_\t_
3\tn't\tnot\tPART\tRB\t_\t4\tadvmod\t_\t_
4\tknow\tknow\tVERB\tVB\tVerbForm=Inf\t0\troot\t_\t_
4.1\tknow\tknow\tVERB\tVB\t_\t_\t_\t4:conj\t_
5-6\tdel\t_\t_\t_\t_\t_\t_\t_\t_
5\tde\tde\tADP\tIN\t_\t7\tcase\t_\t_
6\tel\tel\tDET\tDT\t_\t7\tdet\t_\t_
7\tEye\teye\tNOUN\tNN\tNumber=Sing\t4\tobj\t_\tEntity=(2-abstract-new(3-object-new)|SpaceAfter=No
8\t-\t-\tPUNCT\tHYPH\t_\t9\tpunct\t_\tSpaceAfter=No
9\tTracking\ttracking\tNOUN\tNN\tNumber=Sing\t7\tcompound\t_\tEntity=2)

# sent_id = s2
# text = It works.
1\tIt\tit\tPRON\tPRP\tNumber=Sing\t2\tnsubj\t_\tEntity=(2-abstract-giv)
2\tworks\twork\tVERB\tVBZ\tNumber=Sing|Tense=Pres\t0\troot\t_\tSpaceAfter=No
3\t.\t.\tPUNCT\t.\t_\t2\tpunct\t_\t_

"""


def test_multiword_tokens_empty_nodes_and_text():
    c = parse_conllu_text(HANDMADE, source="hand.conllu")
    s = c[0]
    assert s.text == "I don't know del Eye-Tracking"
    assert [w.form for w in s.words] == ["I", "do", "n't", "know", "de", "el", "Eye", "-", "Tracking"]
    spans = {w.form: s.text[w.start : w.end] for w in s.words}
    assert spans["do"] == "do" and spans["n't"] == "n't"  # forms concatenate to "don't"
    assert spans["de"] == "del" and spans["el"] == "del"  # they do not: the whole token
    assert spans["Tracking"] == "Tracking"
    assert s.n_empty == 1 and s.n_multiword == 2
    assert s.doc_id == "d1" and s.sent_id == "s1"
    assert c[1].text == "It works." and c[1].doc_id == "d1"
    assert s.words[1].line == 7  # the word "do" is on line 7 of the text


def test_gum_entities_nested_and_across_sentences():
    c = parse_conllu_text(HANDMADE)
    m = [(x.start, x.end, x.etype, x.cluster) for x in c[0].mentions]
    assert (0, 1, "person", "d1#1") in m
    assert (6, 9, "abstract", "d1#2") in m  # Eye-Tracking
    assert (6, 7, "object", "d1#3") in m  # one-token mention opened and closed on "Eye"
    assert [(x.start, x.end, x.cluster) for x in c[1].mentions] == [(0, 1, "d1#2")]
    ent = build_task(c, "entity")
    assert sorted(ent.labels.tolist()) == ["abstract", "abstract", "object", "person"]


def test_fixture_files_rebuild_text():
    for name in ("ewt_tiny_train", "ewt_tiny_test", "gum_tiny_train", "gum_tiny_test"):
        c = read_conllu(os.path.join(UD, f"{name}.conllu"))
        assert len(c) > 15
        for s in c:
            assert s.text == s.metadata["text"]
            for w in s.words:
                if s.text[w.start : w.end] != w.form:  # only inside multiword tokens
                    assert w.form in s.text[w.start : w.end] or "-" in str(w.id)
    c = read_conllu(os.path.join(UD, "ewt_tiny_train.conllu"))
    assert sum(s.n_empty for s in c) >= 2 and sum(s.n_multiword for s in c) >= 3
    g = read_conllu(os.path.join(UD, "gum_tiny_train.conllu"))
    assert g.has_entities and g.n_unclosed_mentions == 0
    first = g[0]  # "Aesthetic Appreciation and Spanish Art:"
    assert [(m.start, m.end, m.etype) for m in first.mentions] == [(0, 2, "abstract"), (3, 5, "abstract")]


def test_sample_data_is_bundled():
    paths = sample_data()
    counts = {k: len(read_conllu(p)) for k, p in paths.items()}
    assert 280 <= counts["ewt_train"] <= 350 and 130 <= counts["ewt_test"] <= 170
    assert 180 <= counts["gum_train"] <= 230 and 80 <= counts["gum_test"] <= 120
    assert read_conllu(paths["gum_train"]).has_entities


@pytest.mark.parametrize(
    "line, fix, message",
    [
        (5, lambda l: l.replace("\t", " ", 3), "expected 10 tab-separated columns"),
        (5, lambda l: "x" + l, "bad ID"),
        (5, lambda l: l.replace("\t4\tnsubj", "\tfour\tnsubj"), "HEAD 'four'"),
        (5, lambda l: l.replace("\t4\tnsubj", "\t44\tnsubj"), "points past the last word"),
        (9, lambda l: "2\t" + l.split("\t", 1)[1], "out of order"),
        (5, lambda l: "# a comment\n" + l, None),  # fine: comments before the words
    ],
)
def test_malformed_conllu_reports_file_and_line(tmp_path, line, fix, message):
    lines = HANDMADE.split("\n")
    lines[line - 1] = fix(lines[line - 1])
    p = tmp_path / "bad.conllu"
    p.write_text("\n".join(lines), encoding="utf-8")
    if message is None:
        read_conllu(p)
        return
    with pytest.raises(ConlluError) as e:
        read_conllu(p)
    assert f"{p}:{line}:" in str(e.value) and message in str(e.value)


def test_malformed_conllu_other_cases(tmp_path):
    p = tmp_path / "a.conllu"
    lines = HANDMADE.split("\n")
    lines.insert(8, "# stray comment")  # inside the words of sentence 1 -> line 9
    p.write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(ConlluError, match=r"a\.conllu:9: comment line inside a sentence"):
        read_conllu(p)
    p.write_bytes(HANDMADE.encode().replace(b"know", b"kn\xffw", 1))
    with pytest.raises(ConlluError, match=r"a\.conllu:\d+: bytes that are not valid UTF-8"):
        read_conllu(p)
    p.write_text("# only a comment\n\n", encoding="utf-8")
    with pytest.raises(InputError):
        read_conllu(p)
    with pytest.raises(InputError, match="no such CoNLL-U file"):
        read_conllu(tmp_path / "missing.conllu")


def test_word_and_edge_tasks():
    c = read_conllu(os.path.join(UD, "ewt_tiny_train.conllu"))
    up = build_task(c, "upos")
    assert len(up) == c.n_words and up.kind == "word"
    assert set(up.labels) <= {
        "NOUN",
        "VERB",
        "ADJ",
        "ADV",
        "PRON",
        "DET",
        "ADP",
        "AUX",
        "CCONJ",
        "SCONJ",
        "PART",
        "NUM",
        "PUNCT",
        "PROPN",
        "INTJ",
        "SYM",
        "X",
    }
    num = build_task(c, "feats:Number")
    assert 0 < len(num) < len(up) and set(num.labels) <= {"Sing", "Plur", "Ptan"}
    dep = build_task(c, "deprel")
    assert dep.kind == "edge" and len(dep) == c.n_words
    roots = dep.labels == "root"
    assert roots.sum() == len(c) and (dep.span1[roots] == dep.span2[roots]).all()
    # head of "American" (word 5) in sentence 0 is "forces" (word 6): 0-based 4 -> 5
    i = np.nonzero((dep.sent1 == 0) & (dep.span1[:, 0] == 4))[0][0]
    assert dep.labels[i] == "amod" and tuple(dep.span2[i]) == (5, 6) and dep.keys[i] == "american|forces"
    base = build_task(c, "deprel:base")
    assert not any(":" in x for x in base.labels)
    with pytest.raises(InputError, match="unknown task"):
        build_task(c, "sentiment")
    with pytest.raises(InputError, match="Entity"):
        build_task(c, "entity")


def test_coref_pairs():
    g = read_conllu(os.path.join(UD, "gum_tiny_train.conllu"))
    co = build_task(g, "coref", coref_window=2)
    assert co.kind == "edge" and co.context == "document"
    lab = co.labels.astype(int)
    assert lab.sum() > 10 and abs((lab == 0).sum() - lab.sum()) <= 1  # one negative per positive
    assert (co.sent2 - co.sent1 <= 2).all() and (co.sent2 >= co.sent1).all()
    clusters = {}
    for si, s in enumerate(g.sentences):
        for m in s.mentions:
            clusters[(si, m.start, m.end)] = m.cluster
    for i in range(len(co)):
        c1 = clusters[(co.sent1[i], *co.span1[i])]
        c2 = clusters[(co.sent2[i], *co.span2[i])]
        assert (c1 == c2) == (co.labels[i] == "1")
    again = build_task(g, "coref", coref_window=2)
    assert (again.span1 == co.span1).all() and (again.labels == co.labels).all()  # deterministic
    other = build_task(g, "coref", coref_window=2, seed=1)
    assert not ((other.span1 == co.span1).all() and (other.sent1 == co.sent1).all())


def test_control_labels_deterministic_and_distributed():
    keys = [f"w{i}" for i in range(4000)]
    probs = np.array([0.7, 0.2, 0.1])
    a = control_labels(keys, ["A", "B", "C"], probs, seed=3)
    b = control_labels(keys[::-1], ["A", "B", "C"], probs, seed=3)[::-1]
    assert (a == b).all()  # the same key gets the same label whatever the order
    freq = np.bincount(a, minlength=3) / len(a)
    assert np.abs(freq - probs).max() < 0.03
    c = control_labels(keys, ["A", "B", "C"], probs, seed=4)
    assert (a != c).mean() > 0.3
    assert (
        control_labels(["the", "the"], ["A", "B"], [0.5, 0.5]) == control_labels(["the"], ["A", "B"], [0.5, 0.5])[0]
    ).all()


def test_jiant_jsonl(tmp_path):
    p = tmp_path / "srl.jsonl"
    recs = [
        {
            "text": "The cat sat on the mat .",
            "targets": [
                {"span1": [1, 2], "span2": [2, 3], "label": "ARG0"},
                {"span1": [3, 6], "span2": [2, 3], "label": ["ARGM-LOC"]},
            ],
        },
        {"text": "Dogs bark", "targets": [{"span1": [0, 1], "span2": [1, 2], "label": "ARG0"}]},
    ]
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    c = read_jiant(p)
    ex = build_task(c, "srl")
    assert ex.kind == "edge" and list(ex.labels) == ["ARG0", "ARGM-LOC", "ARG0"]
    assert c[0].span_text(*ex.span1[1]) == "on the mat"
    assert ex.keys[0] == "cat|sat"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a b", "targets": [{"span1": [1, 5], "label": "x"}]}) + "\n")
    with pytest.raises(InputError, match=r"bad\.jsonl:1: span1"):
        read_jiant(bad)
    bad.write_text("{not json\n")
    with pytest.raises(InputError, match=r"bad\.jsonl:1: not valid JSON"):
        read_jiant(bad)


def test_span_tokens_synthetic_offsets():
    # tokens: <bos>(0,0) "Hel"(0,3) "lo"(3,5) " wor"(5,9) "ld"(9,11) <eos>(0,0)
    tok = tokenize_like([(0, 0), (0, 3), (3, 5), (5, 9), (9, 11), (0, 0)])
    first, last = span_tokens(tok[0], tok[1], np.array([0, 6, 0, 11, 6]), np.array([5, 11, 11, 12, 6]))
    assert first.tolist() == [1, 3, 1, -1, -1] and last.tolist() == [2, 4, 4, -1, -1]
    # truncated text: a span past the last kept token is skipped
    tok = tokenize_like([(0, 3), (3, 5)])
    first, last = span_tokens(tok[0], tok[1], np.array([0, 6]), np.array([5, 11]))
    assert first.tolist() == [0, -1]


def tokenize_like(offsets):
    st = np.array([o[0] for o in offsets])
    en = np.array([o[1] for o in offsets])
    pos = 0
    for k in range(len(st)):  # what tokenize_passages does with special tokens
        if en[k] <= st[k]:
            st[k] = en[k] = pos
        else:
            pos = max(pos, en[k])
    return st, en


def test_span_mapping_with_the_real_tokenizer(tokenizer):
    c = parse_conllu_text(HANDMADE)
    passages, where = build_passages(c.sentences, "sentence")
    tok = tokenize_passages(tokenizer, [p.text for p in passages], max_tokens=64)
    s = c[0]
    cs = np.array([w.start for w in s.words])
    ce = np.array([w.end for w in s.words])
    t = map_spans(tok, SpanTable(np.zeros(len(cs), dtype=np.int64), cs, ce))
    ids = tok.ids[0]
    for w, f, l in zip(s.words, t.first, t.last):
        assert f >= 0 and l >= f
        piece = tokenizer.decode(ids[f : l + 1].tolist())
        assert s.text[w.start : w.end].strip() in piece  # the subwords cover the word
    # "do" and "n't" share the subword that straddles them, or split cleanly; never empty
    assert t.last[1] <= t.last[2]
    # truncation: a 3-token budget leaves later words uncovered
    short = tokenize_passages(tokenizer, [passages[0].text], max_tokens=3)
    t2 = map_spans(short, SpanTable(np.zeros(len(cs), dtype=np.int64), cs, ce))
    assert t2.first[0] >= 0 and (t2.first[-3:] == -1).all() and short.n_truncated == 1


def test_document_passages_own_every_sentence_once(tokenizer):
    g = read_conllu(os.path.join(UD, "gum_tiny_train.conllu"))
    passages, where = build_passages(g.sentences, "document", tokenizer=tokenizer, max_tokens=128)
    assert len(passages) > 1
    owned = [s for p in passages for s, o in zip(p.sents, p.owned) if o]
    assert sorted(owned) == list(range(len(g)))
    for i, (p, off) in enumerate(where):
        assert passages[p].text[off : off + len(g[i].text)] == g[i].text
    lens = [len(tokenizer(p.text)["input_ids"]) for p in passages]
    assert max(lens) <= 128 + 8
    # later passages carry preceding context
    assert any(not o for p in passages[1:] for o in p.owned)


def test_bos_is_prepended_only_when_the_tokenizer_adds_none(tokenizer):
    from depthscope.probes.corpora.spans import bos_id

    b = bos_id(tokenizer)
    assert b == tokenizer.bos_token_id  # SmolLM2 adds no special token itself
    c = parse_conllu_text(HANDMADE)
    plain = tokenize_passages(tokenizer, [c[0].text], max_tokens=64)
    withb = tokenize_passages(tokenizer, [c[0].text], max_tokens=64, prepend=b)
    assert withb.ids[0][0] == b and (withb.ids[0][1:] == plain.ids[0]).all()
    cs = np.array([w.start for w in c[0].words])
    ce = np.array([w.end for w in c[0].words])
    t1 = map_spans(plain, SpanTable(np.zeros(len(cs), dtype=np.int64), cs, ce))
    t2 = map_spans(withb, SpanTable(np.zeros(len(cs), dtype=np.int64), cs, ce))
    assert (t2.first == t1.first + 1).all() and (t2.last == t1.last + 1).all()
