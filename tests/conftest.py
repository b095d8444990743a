"""Shared fixtures: the real default model (loaded once per session) and tiny random models
of each supported family (Llama, GPT-2, GPT-NeoX, BERT) that take the default model's
tokenizer, so string inputs work everywhere and tests stay fast."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import matplotlib

matplotlib.use("Agg")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="session")
def default_model():
    """The real SmolLM2-135M-Instruct (converted from its GGUF once, cached)."""
    from depthscope.hooks import load_model

    return load_model()


@pytest.fixture(scope="session")
def tokenizer(default_model):
    return default_model.tokenizer


def make_tiny(family: str, vocab_size: int = 49152, n_layers: int = 3, d_model: int = 64, seed: int = 0):
    """A tiny random-weight transformers model of one family (eval mode, float32)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size)
    if family == "llama":
        cfg = tf.LlamaConfig(hidden_size=d_model, intermediate_size=2 * d_model, num_hidden_layers=n_layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             tie_word_embeddings=True, **common)
        model = tf.LlamaForCausalLM(cfg)
    elif family == "gpt2":
        cfg = tf.GPT2Config(n_embd=d_model, n_layer=n_layers, n_head=4, n_positions=256, **common)
        model = tf.GPT2LMHeadModel(cfg)
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(hidden_size=d_model, intermediate_size=2 * d_model, num_hidden_layers=n_layers,
                               num_attention_heads=4, max_position_embeddings=256, use_parallel_residual=True,
                               **common)
        model = tf.GPTNeoXForCausalLM(cfg)
    elif family == "bert":
        cfg = tf.BertConfig(hidden_size=d_model, intermediate_size=2 * d_model, num_hidden_layers=n_layers,
                            num_attention_heads=4, max_position_embeddings=256, **common)
        model = tf.BertForMaskedLM(cfg)
    else:
        raise ValueError(family)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_factory(tokenizer):
    """tiny_factory(family, **kw) -> HookedModel with the default tokenizer."""
    from depthscope.hooks import load_model

    def make(family: str = "llama", **kw):
        return load_model(make_tiny(family, vocab_size=len(tokenizer), **kw), tokenizer=tokenizer)

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_factory):
    return tiny_factory("llama")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module, restored afterwards (modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``): on a shared 2-core machine two
    threads spin-wait for each other on the many small ops of a forward pass (5-10x slower under
    load); results do not depend on it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
