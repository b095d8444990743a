"""word_features: the probes' word vectors as a public function, equal to the residual stream
read independently at each word's last (or mean of its) subword(s)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from depthscope.hooks import InputError
from depthscope.probes import read_conllu, sample_data, word_features

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = [["The", "cat", "sat", "on", "the", "mat", "."], ["Unbelievably", ",", "it", "rained"]]


def reference(hm, words, sites, pooling):
    """Token offsets from the tokenizer, the stream from residual_stream; BOS prepended."""
    text = " ".join(words)
    enc = hm.tokenizer(text, return_offsets_mapping=True)
    ids = [hm.tokenizer.bos_token_id] + enc["input_ids"]
    offs = [(0, 0)] + enc["offset_mapping"]
    rs = hm.residual_stream(torch.tensor([ids]), sites=sites, return_logits=False)
    out, pos = [], 0
    for w in words:
        a, b = pos, pos + len(w)
        toks = [k for k, (s, e) in enumerate(offs) if e > s and s < b and e > a]
        x = rs.resid[:, 0, toks]
        out.append(x[:, -1] if pooling == "last" else x.mean(1))
        pos = b + 1
    return torch.stack(out, 1).numpy()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_word_lists_equal_the_stream(tiny_llama, tmp_path, pooling):
    hm = tiny_llama
    assert hm.tokenizer("a")["input_ids"][0] != hm.tokenizer.bos_token_id  # so the probes prepend BOS
    wf = word_features(hm, WORDS, sites=["embed", "1.attn", "2.mlp"], pooling=pooling, store_dir=tmp_path)
    assert wf.features.dtype == np.float32 and wf.features.shape == (3, 11, hm.d_model)
    assert list(wf.index.columns) == ["sentence", "word", "form"] and wf.n_skipped == 0
    assert wf.index["form"].tolist() == WORDS[0] + WORDS[1]
    assert wf.sites["label"].tolist() == ["embed", "1.attn", "2.mlp"]
    ref = np.concatenate([reference(hm, w, ["embed", "1.attn", "2.mlp"], pooling) for w in WORDS], 1)
    np.testing.assert_allclose(wf.features, ref, rtol=1e-5, atol=1e-5)
    z = word_features(hm, WORDS, sites=["1.attn"], pooling=pooling, store_dir=tmp_path, standardize=True).features
    np.testing.assert_allclose(z.mean(1), 0, atol=1e-5)
    assert not np.allclose(wf.features[1].mean(0), 0, atol=1e-3)  # raw unless asked


def test_conllu_gold_columns(tiny_llama, tmp_path):
    path = sample_data()["ewt_test"]
    corpus = read_conllu(path, max_sentences=5)
    wf = word_features(tiny_llama, corpus, sites=["2.mlp"], store_dir=tmp_path)
    assert list(wf.index.columns) == ["sentence", "word", "form", "upos", "xpos", "lemma", "feats", "head", "deprel"]
    assert len(wf.index) + wf.n_skipped == corpus.n_words and wf.features.shape == (1, len(wf.index), 64)
    assert wf.index["upos"].tolist()[:3] == [w.upos for w in corpus.sentences[0].words][:3]
    # a sentence whose text is its words joined by spaces: equal to the independent reference
    k = next(i for i, s in enumerate(corpus.sentences) if s.text == " ".join(w.form for w in s.words))
    rows = (wf.index["sentence"] == k).to_numpy()
    ref = reference(tiny_llama, [w.form for w in corpus.sentences[k].words], ["2.mlp"], "last")
    np.testing.assert_allclose(wf.features[:, rows], ref, rtol=1e-5, atol=1e-5)
    # the path and the list of sentences give the same
    wf2 = word_features(tiny_llama, corpus.sentences, sites=["2.mlp"], store_dir=tmp_path)
    assert np.array_equal(wf2.features, wf.features)


def test_bad_input(tiny_llama, tmp_path):
    with pytest.raises(InputError, match="pooling"):
        word_features(tiny_llama, WORDS, pooling="attn", store_dir=tmp_path)
    with pytest.raises(InputError, match="list of non-empty word strings"):
        word_features(tiny_llama, ["The cat sat"], store_dir=tmp_path)
    with pytest.raises(InputError, match="no sentences"):
        word_features(tiny_llama, [], store_dir=tmp_path)
