"""One held-out text (issue 57): every free-text analysis reads documents through
``analyses.text.text_rows`` under one ``TextWindows``. The rows against the tokenizer by hand (the
BOS rule, windows, stride context, caps cut inside a document, resuming where a cap stopped), and
the same clean next-token loss in ``layers``, the causal test and ``evaluate_sae`` on the same
text, all equal to transformers' own loss on the rows."""

from __future__ import annotations

import pytest
import torch

from depthscope.analyses import TextWindows, evaluate_sae, layer_interventions, text_rows
from depthscope.analyses.causal.erasure.loss import doc_nll, held_out
from depthscope.common.errors import InputError
from tests.test_sae import random_sae

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [
    "The cat sat on the mat. The dog sat on the log. A bird flew over the house and sang.",
    "Hello world",
    "",
    "The capital of France is Paris. The capital of Italy is Rome.",
]


@pytest.fixture(scope="module")
def llama(tiny_factory):
    return tiny_factory("llama", n_layers=3)


def _ids(tok, text: str) -> list[int]:
    return tok(text)["input_ids"]


def test_rows_follow_the_bos_rule_windows_and_stride(llama):
    tok, bos = llama.tokenizer, llama.tokenizer.bos_token_id
    body = _ids(tok, DOCS[0])
    rows = text_rows(llama, DOCS, TextWindows(window=8), skip=1)
    mine = [r.tolist() for r, d in zip(rows.rows, rows.doc) if d == 0]
    assert mine == [[bos, *body[i : i + 7]] for i in range(0, len(body), 7)]  # BOS + 7 document tokens each
    assert rows.start == 1 and set(rows.doc.tolist()) == {0, 1, 3} and (rows.first == 1).all()
    assert rows.n_tokens == sum(len(_ids(tok, d)) for d in DOCS)  # each document token predicted once
    plain = text_rows(llama, DOCS, TextWindows(window=8, bos=False), skip=0)
    assert [r.tolist() for r, d in zip(plain.rows, plain.doc) if d == 0] == [
        body[i : i + 8] for i in range(0, len(body), 8)
    ]
    assert plain.start == 0 and plain.n_tokens == sum(len(r) for r in plain.rows)
    # stride 3: each later window repeats 4 tokens of the one before as context, which counts nowhere
    st = text_rows(llama, DOCS[:1], TextWindows(window=8, stride=3), skip=1)
    assert [r.tolist() for r in st.rows][:2] == [[bos, *body[0:7]], [bos, *body[3:10]]]
    assert st.first.tolist()[:2] == [1, 5] and st.n_tokens == len(body)
    counted = [t for r, f in zip(st.rows, st.first) for t in r[f:].tolist()]
    assert counted == body  # every document token counted exactly once, in order
    with pytest.raises(InputError, match="stride"):
        text_rows(llama, DOCS, TextWindows(window=8, stride=8))  # 7 document tokens after the BOS


def test_caps_cut_inside_a_document_and_resume_where_they_stopped(llama):
    tok, bos = llama.tokenizer, llama.tokenizer.bos_token_id
    body = _ids(tok, DOCS[0])
    cut = text_rows(llama, DOCS, TextWindows(window=8, max_tokens=10), skip=1)
    assert cut.n_tokens == 10 and [r.tolist() for r in cut.rows] == [[bos, *body[:7]], [bos, *body[7:10]]]
    assert cut.end == (0, 10) and cut.n_docs == 1
    rest = text_rows(llama, DOCS, TextWindows(window=8, max_tokens=5), skip=1, start=cut.end)
    assert rest.rows[0].tolist() == [bos, *body[10:15]]
    read = text_rows(llama, DOCS, TextWindows(window=8, max_tokens=10), skip=0)  # positions read: the BOS too
    assert read.n_tokens == 10 and [len(r) for r in read.rows] == [8, 2]
    docs = text_rows(llama, DOCS, TextWindows(max_docs=2), skip=1)
    assert set(docs.doc.tolist()) == {0, 1}
    with pytest.raises(InputError, match="no token to predict"):
        text_rows(llama, ["", "a"], TextWindows(bos=False), skip=1)


def test_settings_are_checked():
    with pytest.raises(InputError, match="window must be an integer >= 2"):
        TextWindows(window=1)
    with pytest.raises(InputError, match="stride"):
        TextWindows(window=4, stride=5)
    with pytest.raises(InputError, match="max_tokens"):
        TextWindows(max_tokens=0)


def _hf_loss(model, rows) -> float:
    """Token-weighted transformers loss over the rows, one row at a time (no padding)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.as_tensor(row)[None]
            total += float(model.hf_model(input_ids=ids, labels=ids).loss) * (len(row) - 1)
            n += len(row) - 1
    return total / n


@pytest.mark.parametrize("text", [TextWindows(), TextWindows(window=12, max_tokens=40), TextWindows(bos=False)])
def test_one_clean_loss_in_layers_causal_and_sae_evaluation(llama, text):
    docs = [d for d in DOCS if d] * 3
    held = held_out(llama, docs, text=text)
    causal = doc_nll(llama, held, batch_size=3).mean
    layers = layer_interventions(llama, docs, batch_size=2, text=text, layers=[0])
    sae = random_sae(llama.d_model, 48, "topk", k=6, hook_name="blocks.1.hook_resid_post")
    ev = evaluate_sae(llama, sae, docs, text=text, batch_size=5).iloc[0]
    clean = layers[layers["intervention"] == "none"].iloc[0]
    assert clean["cross_entropy"] == pytest.approx(causal, abs=1e-5)
    assert ev["loss_clean"] == pytest.approx(causal, abs=1e-5)
    assert clean["n_predictions"] == ev["eval_tokens"] == held.n_tokens
    if text.stride is None:  # no context-only tokens: every row's loss is transformers' own
        assert causal == pytest.approx(_hf_loss(llama, held.rows), abs=1e-5)
    if text.max_tokens is not None:
        assert held.n_tokens == text.max_tokens


@pytest.mark.parametrize(
    "text", [TextWindows(window=8), TextWindows(window=8, stride=3), TextWindows(window=8, bos=False)], ids=str
)
@pytest.mark.parametrize("skip", [0, 1])
def test_the_reader_counts_positions_without_reading(llama, text, skip):
    """What a progress bar's total and the split note read: each document's windows and counted
    positions from its token count alone, as the rows have them."""
    from depthscope.analyses.text import RowReader

    reader = RowReader(llama, [], text, skip=skip)
    for d in DOCS:
        rows = text_rows(llama, [d], text, skip=skip, need=False)
        n = len(llama.tokenizer(d)["input_ids"]) if d else 0
        assert reader.positions(n) == rows.n_tokens and reader.n_windows(n) == len(set(rows.window.tolist())), d
