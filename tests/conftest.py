"""Shared fixtures: the real default model (loaded once per session), a tiny byte-level BPE
tokenizer trained here on the test fixtures' text, and tiny random models of each supported
family (Llama, GPT-2, GPT-NeoX, BERT) that take the tiny tokenizer, so string inputs work
everywhere without loading the 135M model.

Tiers: every test that uses the real model (the ``default_model`` or ``tokenizer`` fixtures,
directly or through another fixture) is marked ``slow`` at collection, so ``pytest -m "not slow"``
(``make test-fast``) runs the rest; ``make test`` runs all."""

from __future__ import annotations

import glob
import os

# One thread per test process, set before torch is imported (and inherited by the commands and
# examples the tests start): on a shared 2-core machine two torch threads spin-wait on each other
# over a forward's many small ops (a module went from 218 s to 9 s). Results do not depend on it;
# the tests that measure threading set their own count (test_side_by_side).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import matplotlib  # noqa: E402

matplotlib.use("Agg")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _isolate_cache() -> None:
    """The test session's own depthscope cache (activation stores, locks), so tests never meet
    the stores or locks of a ``make report`` or another test run on the same machine. Only the
    converted default model (``models/``, digest-checked and written atomically) is shared with
    the user's cache, so the 135M model is not dequantised again for every session."""
    import tempfile

    from depthscope.hooks.loading import cache_dir

    user = cache_dir()
    own = tempfile.mkdtemp(prefix="depthscope-test-cache-")
    (user / "models").mkdir(parents=True, exist_ok=True)
    os.symlink(user / "models", os.path.join(own, "models"))
    os.environ["DEPTHSCOPE_CACHE"] = own


_isolate_cache()

#: CPUs ``--fake-cpu`` can stand in for: the flags and torch capability the precision rule reads
FAKE_CPUS = {
    "amx": ("amx_bf16 amx_tile amx_int8 avx512_bf16 avx512f avx512bw avx512vl avx2 fma", "AMX"),
    "avx512-bf16": ("avx512_bf16 avx512f avx512bw avx512vl avx2 fma", "AVX512"),
    "avx2": ("avx2 fma", "AVX2"),
}


def pytest_addoption(parser):
    parser.addoption(
        "--fake-cpu",
        choices=sorted(FAKE_CPUS),
        default=None,
        help="run as if on this CPU: DEPTHSCOPE_CPU_FLAGS / DEPTHSCOPE_CPU_CAPABILITY for this process and the "
        "commands it starts (what the precision rule reads; the kernels' rounding stays this machine's, which "
        "ATEN_CPU_CAPABILITY=default changes)",
    )


def pytest_configure(config):
    fake = config.getoption("--fake-cpu", default=None)
    if fake:
        os.environ["DEPTHSCOPE_CPU_FLAGS"], os.environ["DEPTHSCOPE_CPU_CAPABILITY"] = FAKE_CPUS[fake]


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path, monkeypatch):
    """Every test runs in its own empty working directory: default output folders
    (``depthscope-out``, ``depthscope-report``) and relative paths never land in the checkout."""
    monkeypatch.chdir(tmp_path)


REAL_MODEL_FIXTURES = {"default_model", "tokenizer"}


#: modules whose tests may run on different workers under ``pytest -n`` (pytest-xdist,
#: ``--dist loadgroup``, as ``make test`` runs): independent tests that share only session fixtures.
#: Every other module runs whole on one worker, so its module fixtures are built once.
SPLIT_MODULES = {"test_docs.py", "test_hostile_models.py", "test_hostile_cache.py"}
#: the modules with the longest tests (measured with DEPTHSCOPE_TEST_TIMES), started first so no
#: worker is left with one of them at the end while the other idles
FIRST_MODULES = ("test_docs.py", "test_localize.py", "test_examples.py", "test_hostile_models.py")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` every test that loads the real default model through a fixture (the closure
    of fixtures it requests, so a module fixture built on ``default_model`` counts too); group the
    tests of a module for pytest-xdist unless it is in :data:`SPLIT_MODULES`; run the modules of
    :data:`FIRST_MODULES` first, in that order, and within them the slow tests first."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if item.path.name not in SPLIT_MODULES:
            item.add_marker(pytest.mark.xdist_group(item.path.name))

    def rank(item) -> tuple[int, int]:
        name = item.path.name
        first = FIRST_MODULES.index(name) if name in FIRST_MODULES else len(FIRST_MODULES)
        return first, 0 if first < len(FIRST_MODULES) and item.get_closest_marker("slow") else 1

    items.sort(key=rank)  # stable: the collection order within each rank


# What the tiny tokenizer is trained on: the fixtures' text, plus phrases the tests use as
# prompts and single-token targets (" Paris", " Rome", " the", " Mary", " John").
TINY_PHRASES = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world, this is a longer second sentence with more words.",
    "The cat sat on the mat. The dog sat on the log. A bird flew over the house and sang.",
]
TINY_NAMES = (" Mary", " John")  # single tokens, as in the real tokenizer (the IOI tests need them)
TINY_SPECIALS = {"unk_token": "<|endoftext|>", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
# IOI-style prompt pairs (clean, corrupted, target, foil) of three templates of different lengths:
# the clean prompt's answer is the indirect object, the corrupted one swaps the second subject
IOI_PAIRS = [
    (
        "When Mary and John went to the store, John gave a drink to",
        "When Mary and John went to the store, Mary gave a drink to",
        " Mary",
        " John",
    ),
    (
        "When John and Mary went to the store, Mary gave a drink to",
        "When John and Mary went to the store, John gave a drink to",
        " John",
        " Mary",
    ),
    (
        "Then Mary and John had a long argument, and afterwards John said to",
        "Then Mary and John had a long argument, and afterwards Mary said to",
        " Mary",
        " John",
    ),
    (
        "After the dog sat on the mat, John and Mary went home. John gave the cat to",
        "After the dog sat on the mat, John and Mary went home. Mary gave the cat to",
        " Mary",
        " John",
    ),
]


def tiny_training_text() -> list[str]:
    lines = TINY_PHRASES * 20
    for path in sorted(glob.glob(os.path.join(FIXTURES, "*", "*.txt"))):
        with open(path, encoding="utf-8") as f:
            lines += [ln.strip() for ln in f if ln.strip()]
    for path in sorted(glob.glob(os.path.join(FIXTURES, "ud", "*.conllu"))):
        with open(path, encoding="utf-8") as f:
            lines += [ln[len("# text = ") :].strip() for ln in f if ln.startswith("# text = ")]
    return lines


def make_tiny_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE (any text encodes, offsets map back to characters) trained in-process,
    shaped like SmolLM2's: BOS ``<|im_start|>``, EOS = pad ``<|im_end|>``, no special token added
    by the tokenizer itself, right padding."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TINY_SPECIALS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_training_text(), trainer=trainer)
    # the IOI names as whole tokens (added after training, so every other text tokenizes as before)
    tok.add_tokens([AddedToken(name, normalized=False) for name in TINY_NAMES])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=TINY_SPECIALS["eos_token"], **TINY_SPECIALS)
    fast.padding_side = "right"
    fast.model_max_length = 256
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The tiny byte-level BPE of :func:`make_tiny_tokenizer` (about 1k tokens)."""
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def default_model():
    """The real SmolLM2-135M-Instruct (converted from its GGUF once, cached)."""
    from depthscope.hooks import load_model

    return load_model()


def copy_default_conversion(cache: os.PathLike) -> None:
    """Copy the default model's cached conversion (which the ``default_model`` fixture made or
    found) into the depthscope cache folder ``cache``, so a test that corrupts a conversion starts
    from a good one without converting the GGUF again (20-50 s each)."""
    import shutil
    from pathlib import Path

    from depthscope.hooks import loading

    key = loading._gguf_cache_key(loading.default_gguf_path())
    shutil.copytree(loading.cache_dir() / "models" / key, Path(cache) / "models" / key)


@pytest.fixture(scope="session")
def tokenizer(default_model):
    """The real default model's tokenizer (SmolLM2): tests that use it are ``slow``."""
    return default_model.tokenizer


def make_tiny(family: str, vocab_size: int = 49152, n_layers: int = 3, d_model: int = 64, seed: int = 0):
    """A tiny random-weight transformers model of one family (eval mode, float32)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size)
    if family == "llama":
        cfg = tf.LlamaConfig(
            hidden_size=d_model,
            intermediate_size=2 * d_model,
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            **common,
        )
        model = tf.LlamaForCausalLM(cfg)
    elif family == "gpt2":
        cfg = tf.GPT2Config(n_embd=d_model, n_layer=n_layers, n_head=4, n_positions=256, **common)
        model = tf.GPT2LMHeadModel(cfg)
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(
            hidden_size=d_model,
            intermediate_size=2 * d_model,
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            max_position_embeddings=256,
            use_parallel_residual=True,
            **common,
        )
        model = tf.GPTNeoXForCausalLM(cfg)
    elif family == "bert":
        cfg = tf.BertConfig(
            hidden_size=d_model,
            intermediate_size=2 * d_model,
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            max_position_embeddings=256,
            **common,
        )
        model = tf.BertForMaskedLM(cfg)
    else:
        raise ValueError(family)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_factory(tiny_tokenizer):
    """tiny_factory(family, **kw) -> HookedModel with the tiny tokenizer."""
    from depthscope.hooks import load_model

    def make(family: str = "llama", **kw):
        return load_model(make_tiny(family, vocab_size=len(tiny_tokenizer), **kw), tokenizer=tiny_tokenizer)

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_factory):
    return tiny_factory("llama")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama folder with the tiny tokenizer, as the command line loads it."""
    d = tmp_path_factory.mktemp("tiny_llama_dir")
    make_tiny("llama", vocab_size=len(tiny_tokenizer)).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def run_cli(args, monkeypatch, capsys) -> tuple[int, str, str]:
    """``depthscope ARGS`` in this process: (exit code, stdout, stderr)."""
    import sys

    from depthscope.analyses import cli

    monkeypatch.setattr(sys, "argv", ["depthscope", *map(str, args)])
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


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


def small_causal_config(store, train: int = 40, test: int = 12, epochs: int = 100, **kw):
    """A causal test's settings small enough for the tiny models: ``train``/``test`` sentences of
    the bundled sample, probes of at most ``epochs``, the activation store in ``store``; ``kw``
    (``controls``, ``bootstrap``, ``extraction_sites``...) as CausalConfig's fields."""
    from depthscope.analyses.causal.erasure.config import CausalConfig
    from depthscope.probes.config import DataConfig, ExtractionConfig, ProbeConfig

    sites = kw.pop("extraction_sites", None)
    return CausalConfig(
        data=DataConfig(max_train_sentences=train, max_test_sentences=test),
        extraction=ExtractionConfig(store_dir=str(store), sites=sites),
        probe=ProbeConfig(max_epochs=epochs),
        **kw,
    )


def pytest_runtest_logreport(report):
    """With ``DEPTHSCOPE_TEST_TIMES=FILE``, one line per test phase (node id, phase, seconds) appended
    as each ends: the suite's slow tests can be read while it runs (``--durations`` prints only at the end)."""
    path = os.environ.get("DEPTHSCOPE_TEST_TIMES")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes every worker's
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.2f}\n")
