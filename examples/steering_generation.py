"""Steering generation with a difference-of-means vector in the residual stream.

What it shows
    1. Read the residual stream at one site (``--site``, default the MLP output a third of the
       way up, ``10.mlp`` on the default 30-block model) for two prompt sets: positive and
       negative sentences.
    2. The steering vector is the difference of their mean streams (positive - negative),
       averaged over real tokens, leaving out position 0 (the attention sink, whose stream is
       many times larger than the others').
    3. Generate from a few neutral prompts with ``model.generate(..., hooks={site: fn})``, where
       ``fn`` adds ``scale * vector`` to the stream at that site at every step (the prompt and
       each new token): scale 0 is the plain model, positive scales push towards the positive
       set, negative scales towards the negative set.
    4. Measure the push without sampling noise: the next-token log-probability of positive minus
       negative words (" great" vs " terrible", ...) right after each prompt, per scale.

Outputs (in ``--out``)
    steering.csv / .parquet      one row per (scale, prompt): continuation, sentiment score
    steering_vector.csv / .parquet   the vector's norm beside the typical stream norm at the site
    steering.png                 the sentiment score against the scale, one line per prompt

Run
    python examples/steering_generation.py                       # default model, ~1 min on 2 cores
    python examples/steering_generation.py --site 6.mlp --scales=-3,0,3 --max-new-tokens 12
    python examples/steering_generation.py --model path/to/hf-folder-or.gguf --out steer/
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Two small prompt sets that differ in sentiment and little else. Replace them with your own
# contrast (formal/informal, English/French, ...): the recipe is the same.
POSITIVE = [
    "I love this, it is wonderful and amazing.",
    "What a great day, I feel so happy.",
    "This is excellent, the best thing ever.",
    "I am delighted, everything went perfectly.",
    "Such a beautiful, lovely, joyful moment.",
]
NEGATIVE = [
    "I hate this, it is terrible and awful.",
    "What a horrible day, I feel so sad.",
    "This is dreadful, the worst thing ever.",
    "I am furious, everything went wrong.",
    "Such an ugly, miserable, painful moment.",
]
# Neutral prompts to continue; the steering should colour their continuations.
PROMPTS = [
    "I think the new restaurant downtown is",
    "My trip to the city last week was",
    "The weather this weekend will be",
]
# Word pairs for the sentiment score: log p(positive word) - log p(negative word) as the next token.
SENTIMENT_PAIRS = [(" great", " terrible"), (" good", " bad"), (" wonderful", " awful")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="anything load_model accepts (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="examples-out/steering_generation", help="output folder")
    p.add_argument("--site", default=None, help="residual site to steer at (default: '<n_layers // 3>.mlp')")
    p.add_argument("--scales", default="-3,-1.5,0,1.5,3", help="comma-separated multiples of the vector")
    p.add_argument("--max-new-tokens", type=int, default=20, help="tokens generated per prompt")
    p.add_argument("--max-prompts", type=int, default=len(PROMPTS), help="use only the first N prompts")
    return p.parse_args(argv)


def first_token_id(tokenizer, word: str) -> int:
    """The id of the first token of ``word`` (whole-word tokens on real vocabularies)."""
    return tokenizer(word, add_special_tokens=False)["input_ids"][0]


def main(argv=None):
    args = parse_args(argv)
    import pandas as pd
    import torch

    from depthscope.analyses import write_table
    from depthscope.analyses.style import plt, savefig
    from depthscope.hooks import load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scales = [float(s) for s in args.scales.split(",")]
    prompts = PROMPTS[: max(1, args.max_prompts)]

    model = load_model(args.model)
    site = args.site or f"{model.n_layers // 3}.mlp"
    print(f"model {model.name}: {model.n_layers} blocks, d_model {model.d_model}; steering at {site}")

    # 1-2. Mean stream of each prompt set at the site. return_logits=False stops the forward
    # right after the site, so later blocks cost nothing.
    def mean_stream(texts):
        rs = model.residual_stream(texts, sites=[site], return_logits=False)
        h, keep = rs[site].float(), rs.mask.clone()  # [batch, pos, d_model], True at real tokens
        keep[:, 0] = False  # leave out the attention sink at position 0
        return (h * keep[..., None]).sum((0, 1)) / keep.sum(), h[keep].norm(dim=-1).median()

    with torch.no_grad():
        pos_mean, pos_norm = mean_stream(POSITIVE)
        neg_mean, neg_norm = mean_stream(NEGATIVE)
    vector = pos_mean - neg_mean
    stream_norm = float((pos_norm + neg_norm) / 2)
    print(f"steering vector norm {vector.norm():.2f} (median stream norm at {site}: {stream_norm:.2f})")
    write_table(
        pd.DataFrame([{"site": site, "vector_norm": float(vector.norm()), "median_stream_norm": stream_norm}]),
        out,
        "steering_vector",
    )

    # 3. The hook: called with the stream at the site ([batch, rows, d_model]) and a context
    # (ctx.step is 0 for the prompt, k for the k-th new token); its return value replaces the stream.
    def steer(scale):
        def hook(stream, ctx):
            return stream + scale * vector.to(device=stream.device, dtype=stream.dtype)

        return hook

    tok = model.tokenizer
    pairs = [(first_token_id(tok, a), first_token_id(tok, b)) for a, b in SENTIMENT_PAIRS]
    rows = []
    for scale in scales:
        hooks = {site: steer(scale)} if scale != 0 else None  # scale 0: the plain model, no hook
        # 4. The sentiment score at the next token (one forward, prompts left-padded so the
        # last column is every prompt's last real token).
        with torch.no_grad():
            run = model.run(prompts, hooks=hooks, padding_side="left")
        logp = run.logits[:, -1].float().log_softmax(-1)
        score = torch.stack([logp[:, a] - logp[:, b] for a, b in pairs]).mean(0)
        gen = model.generate(prompts, max_new_tokens=args.max_new_tokens, hooks=hooks)
        for i, prompt in enumerate(prompts):
            rows.append(
                {
                    "site": site,
                    "scale": scale,
                    "prompt": prompt,
                    "continuation": gen.text[i],
                    "sentiment_logprob_diff": float(score[i]),
                }
            )
    df = pd.DataFrame(rows)
    write_table(df, out, "steering")

    # The figure: score against scale, one line per prompt.
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for prompt, part in df.groupby("prompt", sort=False):
        ax.plot(part["scale"], part["sentiment_logprob_diff"], marker="o", label=prompt)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xlabel(f"steering scale (multiples of the positive - negative vector at {site})")
    ax.set_ylabel("next token: log p(positive) - log p(negative)")
    ax.set_title(f"Steering {model.name} at {site}", fontsize=10)
    ax.legend(fontsize=7, frameon=False)
    savefig(fig, out / "steering.png")

    # The summary: plain (scale 0) and steered text of the first prompt.
    print(f"\n{prompts[0]!r} continued:")
    for scale, part in df.groupby("scale"):
        r = part.iloc[0]
        text = r["continuation"].replace("\n", " ")
        name = "plain     " if scale == 0 else f"scale {scale:+4.1f}"
        print(f"  {name}  sentiment {r['sentiment_logprob_diff']:+6.2f}  ...{text}")
    by_scale = df.groupby("scale")["sentiment_logprob_diff"].mean()
    print("\nmean sentiment score per scale: " + ", ".join(f"{s:+g}: {v:+.2f}" for s, v in by_scale.items()))
    print(f"tables and figure in {out}/")


if __name__ == "__main__":
    main()
