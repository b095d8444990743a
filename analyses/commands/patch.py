"""``depthscope patch``: activation and attribution patching of a clean/corrupted prompt pair."""

from __future__ import annotations

from pathlib import Path

import typer

from depthscope.analyses.jobs.patch import PatchConfig

from .common import DeviceOpt, DtypeOpt, ForceOpt, ModelOpt, OutOpt, ThreadsOpt, prepare_out, set_threads

_D = PatchConfig()


def register(app: typer.Typer) -> None:
    @app.command("patch")
    def patch(
        clean: str = typer.Option(
            _D.clean, "--clean", help="The clean prompt (default: the IOI example with 'John' as the giver)."
        ),
        corrupted: str = typer.Option(
            _D.corrupted, "--corrupted", help="The corrupted prompt (default: the same with 'Mary' as the giver)."
        ),
        target: str = typer.Option(
            _D.target,
            "--target",
            help="Token the clean prompt should predict next, one token (mind the leading space: ' Mary').",
        ),
        foil: str = typer.Option(
            _D.foil or "",
            "--foil",
            help="Contrast token: the metric is logit[target] - logit[foil] at the last token; '' for the "
            "log-probability of the target.",
        ),
        positions: str = typer.Option(
            _D.positions,
            "--positions",
            help="Token positions to patch: last (the last token), all (every position at once) or each "
            "(one patch per position; prompts of the same token length).",
        ),
        sites: str | None = typer.Option(
            _D.sites,
            "--sites",
            help="Comma-separated hook points or group words (e.g. 'embed,10.attn,23.heads' or "
            "'resid,attn_out,mlp_out,heads,z'); default: every residual site.",
        ),
        attribution: bool = typer.Option(
            _D.attribution,
            "--attribution/--no-attribution",
            help="Also the gradient (attribution patching) estimate of every patch, and its rank correlation "
            "with exact patching.",
        ),
        batch_tokens: int = typer.Option(
            _D.batch_tokens,
            "--batch-tokens",
            min=1,
            help="Tokens per forward pass (patched rows x recomputed positions).",
        ),
        threads: int | None = ThreadsOpt,
        plots: bool = typer.Option(
            _D.plots, "--plots/--no-plots", help="Draw the heatmaps (and the attribution-vs-exact scatter)."
        ),
        model: str | None = ModelOpt,
        device: str = DeviceOpt,
        dtype: str = DtypeOpt,
        out: Path = OutOpt,
        force: bool = ForceOpt,
    ):
        """Which activations carry the difference between a clean and a corrupted prompt.

        Copies the CLEAN run's activation at each hook point (and position) into the CORRUPTED
        run, many patches per forward pass, and writes to OUT the table patching (Parquet + CSV;
        one row per patch and method, with the fraction of the clean-vs-corrupted metric gap each
        patch recovers) and the figures patching_sites.png (hook point x position),
        patching_heads.png (layer x head, when per-head points are patched) and
        patching_attribution.png (attribution vs exact).
        """
        from rich.console import Console
        from rich.table import Table

        from depthscope.analyses.jobs import Output
        from depthscope.analyses.jobs.patch import patch_job
        from depthscope.hooks import load_model

        set_threads(threads)
        config = PatchConfig(
            clean=clean,
            corrupted=corrupted,
            target=target,
            foil=foil or None,
            sites=sites,
            positions=positions,
            attribution=attribution,
            batch_tokens=batch_tokens,
            plots=plots,
        ).validate()
        prepare_out(out, "patch", {"model": model or "default", "clean": clean, "corrupted": corrupted}, force)
        console = Console(stderr=True)
        m = load_model(model, device=device, dtype=dtype)
        console.print(repr(m))
        result = patch_job(m, config, Output(out))
        s = result.summary
        t = Table("quantity", "value", title=f"patching {m.name}: {s['metric']} ({s['positions']} positions)")
        t.add_row("clean / corrupted", f"{s['clean_metric']:.3f} / {s['corrupted_metric']:.3f}")
        t.add_row("patches", str(s["n_patches"]))
        for where, frac in s["top"]:
            t.add_row(where, f"{frac:+.3f} recovered")
        if s.get("spearman_attribution_vs_exact") is not None:
            t.add_row("attribution vs exact (Spearman)", f"{s['spearman_attribution_vs_exact']:.3f}")
        if s["notes"]:
            t.add_row("note", s["notes"])
        Console().print(t)
        for p in result.files:
            print(f"wrote {p}")
