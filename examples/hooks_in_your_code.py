"""Hooks in your own code: cache, differentiate and edit at hook points in one call.

What it shows, for one prompt and one target token (default: "The capital of France is" -> " Paris")
    1. ``model.run(prompt, cache=[...], grad=True)``: one forward that keeps the input embedding
       and every sublayer's write into the stream (``l.attn_out``, ``l.mlp_out``) with their
       gradients; ``.backward()`` on the target's logit at the last position, then
       ``run.grad(name)``.
    2. Token saliency: gradient x input at the embedding, summed over d_model, per prompt token.
    3. Gradient x activation per sublayer write: the first-order estimate of how much the
       target's logit would drop if that write were removed (``-grad . write``).
    4. The exact answer with an editing hook: ``model.run(prompt, hooks={"l.mlp_out": zero})``
       zero-ablates one write (a hook returns the replacement tensor), one forward per sublayer;
       and how well the gradient estimate ranks the writes (Spearman).

Outputs (in ``--out``)
    saliency_tokens.csv / .parquet     one row per prompt token: gradient x input, gradient norm
    saliency_sublayers.csv / .parquet  one row per sublayer write (site columns): estimate and ablation effect
    saliency.png                       token saliency, and both effects against depth

Run
    python examples/hooks_in_your_code.py                      # default model, under a minute
    python examples/hooks_in_your_code.py --prompt "The Eiffel Tower is in the city of" --target " Paris"
    python examples/hooks_in_your_code.py --model path/to/hf-folder-or.gguf --out saliency/
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="anything load_model accepts (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="examples-out/hooks_in_your_code", help="output folder")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--target", default=" Paris", help="the token whose logit is explained (its first token)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import pandas as pd
    import torch

    from depthscope.analyses import write_table
    from depthscope.analyses.style import depth_axis, plt, savefig
    from depthscope.hooks import load_model, site_frame

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    tok = model.tokenizer
    target = tok(args.target, add_special_tokens=False)["input_ids"][0]
    print(f"model {model.name}: {model.n_layers} blocks")
    print(f"explaining logit({tok.decode([target])!r}) at the last token of {args.prompt!r}")

    # 1. One forward that caches the embedding and every sublayer write, with gradients.
    writes = [f"{l}.{kind}" for l in range(model.n_layers) for kind in ("attn_out", "mlp_out")]
    run = model.run(args.prompt, cache=["embed", *writes], grad=True)
    target_logit = run.logits[0, -1, target]
    target_logit.backward()
    base = float(target_logit.detach())
    print(f"logit {base:.2f}; the model's top next token: {tok.decode([int(run.logits[0, -1].argmax())])!r}")

    # 2. Gradient x input per token (the stream at "embed" is block 0's input).
    emb, g_emb = run["embed"][0].detach(), run.grad("embed")[0]  # [pos, d_model]
    ids, _ = model.tokenize(args.prompt)  # the token ids model.run used
    tokens = [tok.decode([int(i)]) for i in ids[0]]
    tokens_df = pd.DataFrame(
        {
            "position": range(emb.shape[0]),
            "token": tokens,
            "grad_x_input": (g_emb * emb).sum(-1).tolist(),
            "grad_norm": g_emb.norm(dim=-1).tolist(),
        }
    )
    write_table(tokens_df, out, "saliency_tokens")

    # 3-4. Per sublayer write: the gradient estimate of removing it, and the real removal.
    def zero(t, ctx):  # an editing hook: return the replacement (same shape and dtype)
        return torch.zeros_like(t)

    rows = []
    for name in writes:
        estimate = -float((run.grad(name)[0] * run[name][0].detach()).sum())
        with torch.no_grad():
            ablated = model.run(args.prompt, hooks={name: zero}).logits[0, -1, target]
        rows.append({"point": name, "estimated_effect": estimate, "ablation_effect": float(ablated) - base})
    # the write of l.attn_out lands in site l.attn, that of l.mlp_out in l.mlp: shared site columns
    sites = site_frame([model.site_index(w.replace("_out", "")) for w in writes], model.n_layers)
    subl = pd.concat([sites, pd.DataFrame(rows)], axis=1)
    write_table(subl, out, "saliency_sublayers")
    rho = subl["estimated_effect"].corr(subl["ablation_effect"], method="spearman")

    # Figure: token saliency (left), both effects against depth (right).
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [1, 1.6]})
    ax1.bar(range(len(tokens_df)), tokens_df["grad_x_input"], color="#1f77b4")
    ax1.set_xticks(range(len(tokens_df)))
    ax1.set_xticklabels([repr(t) for t in tokens_df["token"]], rotation=60, fontsize=8)
    ax1.set_ylabel("gradient x input")
    ax1.set_title("token saliency", fontsize=10)
    ax2.plot(subl["depth"], subl["estimated_effect"], marker="o", ms=3, label="gradient x activation estimate")
    ax2.plot(subl["depth"], subl["ablation_effect"], marker="^", ms=3, label="zero-ablation (exact)")
    ax2.axhline(0, color="black", lw=0.6)
    depth_axis(ax2, model.n_layers)
    ax2.set_ylabel(f"change of logit({tok.decode([target])!r})")
    ax2.set_title(f"removing one sublayer write (Spearman {rho:.2f})", fontsize=10)
    ax2.legend(frameon=False, fontsize=8)
    savefig(fig, out / "saliency.png")

    top = tokens_df.loc[tokens_df["grad_x_input"].abs().idxmax()]
    worst = subl.loc[subl["ablation_effect"].idxmin()]
    print(f"most salient token: {top['token']!r} (gradient x input {top['grad_x_input']:+.2f})")
    print(
        f"removing {worst['point']} lowers the logit most: {worst['ablation_effect']:+.2f} "
        f"(estimate {worst['estimated_effect']:+.2f}); Spearman(estimate, exact) over {len(subl)} writes: {rho:.2f}"
    )
    print(f"tables and figure in {out}/")


if __name__ == "__main__":
    main()
