"""A real (tiny) training run that saves a series of checkpoints, for sweeps, tests and demos.

``train_tiny_series`` trains a small random-initialised Llama-style decoder on text with the
given tokenizer and saves Hugging Face folders ``step{N}/`` (safetensors, config, tokenizer)
every ``save_every`` steps: a genuine training trajectory in a minute on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def train_tiny_series(
    out_dir,
    texts: Sequence[str],
    tokenizer,
    *,
    steps: int = 200,
    save_every: int = 50,
    n_layers: int = 2,
    d_model: int = 64,
    seq_len: int = 32,
    batch_size: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    save_initial: bool = True,
) -> list[Path]:
    """Train a tiny Llama on ``texts`` and save checkpoints; returns the checkpoint folders."""
    import transformers as tf

    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = [
        i for t in texts for i in tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id or 0]
    ]
    if len(ids) < seq_len + 1:
        raise ValueError("not enough text to train on")
    data = torch.tensor(ids, dtype=torch.long)
    # the softmax is taken over the token ids the text uses (a full-vocabulary softmax would
    # dominate the cost of so small a model); the saved model keeps the tokenizer's vocabulary
    used = torch.unique(data)
    remap = torch.full((len(tokenizer),), -1, dtype=torch.long)
    remap[used] = torch.arange(len(used))
    cfg = tf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=d_model,
        intermediate_size=2 * d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(128, seq_len),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = tf.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    saved: list[Path] = []

    def save(step: int):
        saved.append(_save_checkpoint(model, tokenizer, out / f"step{step}"))

    model.train()
    g = torch.Generator().manual_seed(seed)
    if save_initial:
        save(0)
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
        x = torch.stack([data[s : s + seq_len] for s in starts])
        hidden = model.model(input_ids=x).last_hidden_state[:, :-1]
        logits = hidden @ model.lm_head.weight[used].T
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, len(used)), remap[x[:, 1:]].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % save_every == 0:
            model.eval()
            save(step)
            model.train()
    model.eval()
    return saved


def _save_checkpoint(model, tokenizer, folder: Path) -> Path:
    """A Hugging Face folder (safetensors, config, tokenizer), without transformers' per-save bar."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(folder)
    return folder
