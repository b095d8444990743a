"""Issue 36, classes 5 and 6: data that lie and requests past the model's bounds.

Every reader of data files (CoNLL-U, jiant JSONL, plain text) drops a byte-order mark and refuses
bytes that are not UTF-8 with ``file:line``; a jiant record of the wrong shape is a ``file:line``
error, not a TypeError. Generation checks its budget against the context before any forward and
stops at logits with NaN or inf, naming the step and the hook; a hook returning a meta tensor, an
encoder given to patching and a layer the model lacks are clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

from depthscope.analyses.cli import app
from depthscope.common.errors import ContextLengthError, InputError, NonFiniteActivationError

UD = os.path.join(os.path.dirname(__file__), "fixtures", "ud")
EWT_TRAIN, EWT_TEST = os.path.join(UD, "ewt_tiny_train.conllu"), os.path.join(UD, "ewt_tiny_test.conllu")
GOOD = {"text": "the cat sat", "targets": [{"span1": [1, 2], "label": "NOUN"}]}
CONLLU = "1\tcafé\tcafé\tNOUN\t_\t_\t0\troot\t_\t_\n\n"


@pytest.fixture
def no_model(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the model was loaded before the data were checked")

    monkeypatch.setattr("depthscope.probes.store.extraction.resolve_model", boom)
    monkeypatch.setattr("depthscope.hooks.load_model", boom)


def _jsonl(tmp_path, *records) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return str(path)


# ----------------------------------------------------------------------------- class 5: data
@pytest.mark.parametrize(
    "record,match",
    [
        ('{"text": "a b c", "targets": [null]}', "target 0 is null"),
        ('{"text": "a b c", "targets": [[0, 1]]}', "target 0 is a list"),
        ('{"text": "a b c", "targets": ["span1"]}', "target 0 is a string"),
        ('{"text": "a b c", "targets": null}', "'targets' must be a list"),
        ('{"text": "a b c", "targets": [{"span1": [0, 1], "label": null}]}', "label must be .* got null"),
        ('{"text": "a b c", "targets": [{"span1": [0, 1], "label": {"a": 1}}]}', "label must be"),
        ('{"text": "a b c", "targets": [{"span1": [false, true], "label": "x"}]}', "span1 .* is not"),
        ('{"text": null, "targets": [{"span1": [0, 1], "label": "x"}]}', "'text' must be a string, got null"),
        ('{"text": ["a"], "targets": [{"span1": [0, 1], "label": "x"}]}', "'text' must be a string, got a list"),
        ('{"text": "a b", "info": "x", "targets": [{"span1": [0, 1], "label": "x"}]}', "'info' must be an object"),
        ('{"text": "a b", "info": {"document_id": [1]}, "targets": []}', "document_id must be"),
    ],
)
def test_jiant_records_of_the_wrong_shape_name_file_and_line(tmp_path, record, match):
    from depthscope.probes.corpora.tasks import build_task, read_jiant

    path = _jsonl(tmp_path, GOOD, record)
    with pytest.raises(InputError, match=match) as e:
        build_task(read_jiant(path), "pos")
    assert str(e.value).startswith(f"{path}:2: ")


def test_jiant_labels_that_are_strings_numbers_or_lists_are_read(tmp_path):
    from depthscope.probes.corpora.tasks import build_task, read_jiant

    rec = {"text": "a b c", "targets": [{"span1": [0, 1], "label": 3}, {"span1": [1, 2], "label": ["y", "x"]}]}
    ex = build_task(read_jiant(_jsonl(tmp_path, GOOD, rec)), "pos")
    assert list(ex.labels) == ["NOUN", "3", "x+y"]


def _readers():
    """(suffix, content, read) of each data reader: the first word each reads."""
    from depthscope.analyses.text import read_documents
    from depthscope.probes.corpora.conllu import read_conllu
    from depthscope.probes.corpora.tasks import read_jiant

    return [
        (".conllu", CONLLU, lambda p: read_conllu(p).sentences[0].words[0].form),
        (
            ".jsonl",
            json.dumps({"text": "café b", "targets": []}, ensure_ascii=False) + "\n",
            lambda p: read_jiant(p).sentences[0].words[0].form,
        ),
        (".txt", "café b\n", lambda p: read_documents(p)[0].split()[0]),
    ]


@pytest.mark.parametrize("i", range(3))
def test_every_reader_drops_a_bom(tmp_path, i):
    suffix, content, read = _readers()[i]
    plain, bom = tmp_path / f"plain{suffix}", tmp_path / f"bom{suffix}"
    plain.write_bytes(content.encode("utf-8"))
    bom.write_bytes(b"\xef\xbb\xbf" + content.encode("utf-8"))
    assert read(bom) == read(plain) == "café"


@pytest.mark.parametrize("i", range(3))
def test_every_reader_refuses_latin1_with_file_and_line(tmp_path, i):
    suffix, content, read = _readers()[i]
    path = tmp_path / f"latin{suffix}"
    path.write_bytes(
        ("\n" + content).encode("latin-1") if suffix != ".conllu" else ("# c\n" + content).encode("latin-1")
    )
    with pytest.raises(InputError) as e:
        read(path)
    assert str(e.value).startswith(f"{path}:2: bytes that are not valid UTF-8 on line 2")


def test_cli_probe_on_a_broken_jiant_file_is_a_message(tmp_path, no_model):
    bad = _jsonl(tmp_path, GOOD, '{"text": "a b", "targets": [null]}')
    r = CliRunner().invoke(app, ["probe", "--task", "pos", "--train", bad, "--test", bad, "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    assert f"{bad}:2: target 0 is null" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- class 6: generation
def _short_context(tiny_tokenizer, family: str, n_ctx: int = 16):
    """A tiny model of ``family`` whose context is ``n_ctx`` tokens."""
    import transformers as tf

    from depthscope.hooks import load_model

    torch.manual_seed(0)
    v = len(tiny_tokenizer)
    if family == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=n_ctx, vocab_size=v))
    else:
        cfg = tf.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=n_ctx,
            vocab_size=v,
        )
        model = tf.LlamaForCausalLM(cfg)
    return load_model(model.eval(), tokenizer=tiny_tokenizer)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generation_fits_the_context_or_is_refused_up_front(tiny_tokenizer, family):
    m = _short_context(tiny_tokenizer, family)
    n = m.tokenizer("hello there", return_tensors="pt")["input_ids"].shape[1]
    room = 16 - n
    out = m.generate(["hello there"], max_new_tokens=room, min_new_tokens=room)
    assert out.sequences.shape[1] == 16  # the whole budget runs (absolute positions included)
    for too_many in (room + 1, 10**9):
        with pytest.raises(ContextLengthError, match=f"use max_new_tokens <= {room}"):
            m.generate(["hello there"], max_new_tokens=too_many)


def test_a_nan_hook_during_generation_names_the_step_and_the_hook(tiny_llama):
    def nan_at_2(t, ctx):
        return t * float("nan") if ctx.step == 2 else None

    with pytest.raises(NonFiniteActivationError, match=r"generation step 2 .*hook\(s\) at 1\.attn") as e:
        tiny_llama.generate(["hello there"], max_new_tokens=4, hooks={"1.attn": nan_at_2})
    assert "no token was generated" in str(e.value)


def test_non_finite_logits_without_a_hook_are_refused(tiny_llama):
    """Logits made NaN with no hook involved (here by a caller's logits processor, as an overflow
    in the model's dtype would): the check of the logits alone catches them."""

    class Poison:
        def __call__(self, input_ids, scores):
            return scores * float("nan")

    with pytest.raises(NonFiniteActivationError, match="generation step 0 .*stream became non-finite"):
        tiny_llama.generate(["hello there"], max_new_tokens=2, logits_processor=[Poison()])


def test_a_minus_inf_mask_in_a_hook_is_not_an_error(tiny_llama):
    """-inf in attention scores is a legitimate mask: masking the future again changes nothing."""

    def mask_future(t, ctx):
        q, k = t.shape[-2:]
        future = torch.ones(q, k, dtype=torch.bool).triu(k - q + 1)
        return t.masked_fill(future, float("-inf"))

    plain = tiny_llama.generate(["hello there"], max_new_tokens=4)
    masked = tiny_llama.generate(["hello there"], max_new_tokens=4, hooks={"0.scores": mask_future})
    assert torch.equal(plain.sequences, masked.sequences)


def test_a_hook_returning_a_meta_tensor_says_so(tiny_llama):
    with pytest.raises(InputError, match="meta device"):
        tiny_llama.run("hello there", hooks={"1.attn": lambda t, ctx: torch.empty_like(t, device="meta")})


# ----------------------------------------------------------------------------- class 6: patching
@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tiny_tokenizer):
    from conftest import make_tiny

    dirs = {}
    for family in ("llama", "bert"):
        d = tmp_path_factory.mktemp(family)
        make_tiny(family, vocab_size=len(tiny_tokenizer), n_layers=2, d_model=32).save_pretrained(d)
        tiny_tokenizer.save_pretrained(d)
        dirs[family] = str(d)
    return dirs


def test_patching_an_encoder_is_refused(tiny_factory):
    from depthscope.analyses.circuits.patching.activation import activation_patching

    bert = tiny_factory("bert", n_layers=2, d_model=32)
    with pytest.raises(InputError, match="is an encoder .* patch a decoder"):
        activation_patching(bert, "When Mary and John went", "When John and Mary went", (" Mary", " John"))


@pytest.mark.parametrize(
    "family,extra,match",
    [
        ("bert", [], "is an encoder"),
        ("llama", ["--sites", "99.attn"], "layer 99 out of range: this model has 2 layers, numbered 0..1"),
        ("llama", ["--sites", "5.heads"], "layer 5 out of range"),
    ],
)
def test_cli_patch_refusals_are_messages(tiny_dirs, tmp_path, family, extra, match):
    out = tmp_path / "o"
    r = CliRunner().invoke(app, ["patch", "--model", tiny_dirs[family], *extra, "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert match in r.output and "Traceback" not in r.output and "Valid names" not in r.output
    assert not out.exists()


@pytest.mark.parametrize("point", ["1.q", "1.k", "1.v", "1.rot_q", "1.scores", "1.attn", "1.z"])
def test_a_nan_replacement_is_named_even_when_the_output_stays_finite(tiny_llama, point):
    """An attention kernel can turn a NaN query into finite output: the engine names the hook
    itself, in run and in generation; -inf stays allowed in scores (a mask)."""
    from depthscope.common.errors import NonFiniteActivationError

    texts = ["The capital of France is"]
    with pytest.raises(NonFiniteActivationError, match=f"hook at {point} returned NaN or inf"):
        tiny_llama.run(texts, hooks={point: lambda t, ctx: t * float("nan")})
    with pytest.raises(NonFiniteActivationError, match=point.replace(".", r"\.")):
        tiny_llama.generate(texts, max_new_tokens=2, hooks={point: lambda t, ctx: t * float("nan")})
    masked = tiny_llama.run(
        texts, hooks={"1.scores": lambda t, ctx: t.masked_fill(torch.rand_like(t) < 0.2, float("-inf"))}
    )
    assert masked.logits.shape[-1] == tiny_llama.vocab_size


@pytest.mark.parametrize(
    "body",
    [
        '{"text": "The cat sat", "targets": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"text": "a b", "targets": ' + "9" * 5000 + "}",
    ],
    ids=["nested", "huge-integer"],
)
def test_json_past_the_parser_limits_is_a_clear_error(tmp_path, body):
    """Nesting past Python's stack and integers past 4300 digits are bad JSON lines (file:line),
    in jiant files and in pairs files alike."""
    from depthscope.analyses.circuits.pairs import read_pairs
    from depthscope.probes import read_jiant

    path = tmp_path / "bad.jsonl"
    path.write_text(body + "\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"bad\.jsonl:1: not valid JSON"):
        read_jiant(path)
    with pytest.raises(InputError, match=r"bad\.jsonl:1: not a JSON object"):
        read_pairs(path)


def test_train_and_test_of_different_task_kinds_are_refused_before_extraction(tmp_path):
    """A CoNLL-U train file (upos: one word per example) with a jiant test file (two spans) used
    would fail with a shape error after extraction; it is refused when the examples are built."""
    from depthscope.probes import DataConfig, read_jiant
    from depthscope.probes.store.extraction import _examples

    conllu = tmp_path / "train.conllu"
    conllu.write_text(
        "# text = The cat sat\n1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_\n2\tcat\tcat\tNOUN\tNN\t_\t3\tnsubj\t_\t_\n"
        "3\tsat\tsit\tVERB\tVBD\t_\t0\troot\t_\t_\n\n",
        encoding="utf-8",
    )
    jiant = tmp_path / "test.jsonl"
    jiant.write_text('{"text": "The cat sat", "targets": [{"span1": [1, 2], "span2": [2, 3], "label": "upos"}]}\n')
    from depthscope.probes import read_conllu

    corpora = {"train": read_conllu(conllu), "test": read_jiant(jiant)}
    with pytest.raises(InputError, match=r"not the same kind of task in every split \(train: word"):
        _examples(["upos"], corpora, DataConfig(), {"upos": "sentence"}, seed=0)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (dict(num_beams=10**9), r"num_beams must be at most 1 \(generate keeps one sequence per prompt"),
        (dict(num_return_sequences=2, do_sample=True), "num_return_sequences must be at most 1"),
        (dict(temperature=float("nan"), do_sample=True), "temperature must be a finite number > 0"),
        (dict(top_p=1.5, do_sample=True), "top_p must be at most 1"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(max_length=10**9), "give max_new_tokens"),
    ],
)
def test_generation_settings_are_bounded(tiny_llama, settings, match):
    """Settings passed on to transformers' generate are checked first: none allocates without
    bound (num_beams=10**9 would try 40 GB) or means nothing (nan temperature)."""
    with pytest.raises(InputError, match=match):
        tiny_llama.generate(["The capital of France is"], max_new_tokens=2, **settings)
    ok = tiny_llama.generate(["The capital of France is"], max_new_tokens=2, do_sample=True, temperature=0.7, top_k=5)
    assert len(ok.tokens[0]) == 2
