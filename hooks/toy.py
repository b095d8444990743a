"""A real (tiny) training run that saves a series of checkpoints, for sweeps, tests and demos.

``train_tiny_series(out_dir, texts, tokenizer, steps=..., ...)`` trains a small random-initialised
Llama-style decoder on text with the given tokenizer and saves Hugging Face folders ``step{N}/``
(safetensors, config, tokenizer) every ``save_every`` steps: a genuine training trajectory in a
minute on a CPU. The settings are the fields of :class:`TinySeries`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import transformers as tf
from transformers.utils import logging as hf_logging


@dataclass(frozen=True)
class TinySeries:
    """How the tiny series is trained: ``steps`` AdamW steps of ``batch_size`` windows of
    ``seq_len`` tokens at learning rate ``lr``, a checkpoint every ``save_every`` steps (and at
    step 0 when ``save_initial``), a Llama of ``n_layers`` blocks of width ``d_model``."""

    steps: int = 200
    save_every: int = 50
    n_layers: int = 2
    d_model: int = 64
    seq_len: int = 32
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0
    save_initial: bool = True


def train_tiny_series(
    out_dir, texts: Sequence[str], tokenizer, config: TinySeries | None = None, **settings
) -> list[Path]:
    """Train a tiny Llama on ``texts`` and save checkpoints; returns the checkpoint folders.
    ``settings`` override fields of ``config`` (:class:`TinySeries`), e.g. ``steps=60``."""
    cfg = replace(config or TinySeries(), **settings)
    torch.manual_seed(cfg.seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = _token_stream(texts, tokenizer, cfg.seq_len)
    # the softmax is taken over the token ids the text uses (a full-vocabulary softmax would
    # dominate the cost of so small a model); the saved model keeps the tokenizer's vocabulary
    used = torch.unique(data)
    remap = torch.full((len(tokenizer),), -1, dtype=torch.long)
    remap[used] = torch.arange(len(used))
    model = _tiny_llama(tokenizer, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(cfg.seed)
    saved = [_save_checkpoint(model, tokenizer, out / "step0")] if cfg.save_initial else []
    model.train()
    for step in range(1, cfg.steps + 1):
        starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch_size,), generator=g)
        x = torch.stack([data[s : s + cfg.seq_len] for s in starts])
        hidden = model.model(input_ids=x).last_hidden_state[:, :-1]
        logits = hidden @ model.lm_head.weight[used].T
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, len(used)), remap[x[:, 1:]].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % cfg.save_every == 0:
            saved.append(_save_checkpoint(model, tokenizer, out / f"step{step}"))
    model.eval()
    return saved


def _token_stream(texts: Sequence[str], tokenizer, seq_len: int) -> torch.Tensor:
    """All texts as one stream of token ids, each text followed by the end-of-sequence id."""
    eos = tokenizer.eos_token_id or 0
    ids = [i for t in texts for i in tokenizer(t, add_special_tokens=False)["input_ids"] + [eos]]
    if len(ids) < seq_len + 1:
        raise ValueError("not enough text to train on")
    return torch.tensor(ids, dtype=torch.long)


def _tiny_llama(tokenizer, cfg: TinySeries) -> tf.LlamaForCausalLM:
    """A random-initialised Llama with tied embeddings over the tokenizer's vocabulary."""
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.d_model,
        intermediate_size=2 * cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(128, cfg.seq_len),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return tf.LlamaForCausalLM(config)


def _save_checkpoint(model, tokenizer, folder: Path) -> Path:
    """A Hugging Face folder (safetensors, config, tokenizer), without transformers' per-save bar.
    The model is saved in eval mode and put back in training mode."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    model.eval()
    try:
        model.save_pretrained(folder, safe_serialization=True)
    finally:
        model.train()
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(folder)
    return folder
