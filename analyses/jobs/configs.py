"""The settings of every job: one frozen dataclass per analysis, torch-free, checked on
construction, whose fields declare the command-line options (default, flag, bounds, help:
:func:`depthscope.common.settings.setting`).

The commands import this module to build their options, so ``depthscope --help`` imports no
torch, pandas or matplotlib; the job modules beside it import those at their top.

=========================  ====================================================================
:class:`ModelSpec`         the model every command loads: ``--model``, ``--device``, ``--dtype``,
                           ``--threads``
:class:`LensConfig`        :func:`~depthscope.analyses.jobs.lens.lens_job` (``depthscope lens``)
:class:`LensTrainConfig`   :func:`~depthscope.analyses.jobs.lens.lens_train_job` (``lens-train``)
:class:`NormsConfig`       :func:`~depthscope.analyses.jobs.norms.norms_job` (``depthscope norms``)
:class:`PatchConfig`       :func:`~depthscope.analyses.jobs.patch.patch_job` (``depthscope patch``)
:class:`ProbeJobConfig`    :func:`~depthscope.analyses.jobs.probe.run_probe_job` (``depthscope probe``)
:class:`SweepJobConfig`    :func:`~depthscope.analyses.jobs.sweep.sweep_job` (``depthscope sweep``)
:class:`CacheConfig`       :func:`~depthscope.analyses.jobs.cache.cache_job` (``depthscope cache``)
:class:`ReportConfig`      :func:`~depthscope.analyses.report.run_report` (``depthscope run``)
:class:`LayersConfig`      :func:`~depthscope.analyses.jobs.layers.layers_job` (``depthscope layers``)
=========================  ====================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from depthscope.analyses.sweep_ray import RayEngine, require_ray
from depthscope.analyses.tuned_lens_config import TunedLensTraining
from depthscope.common.errors import InputError
from depthscope.common.settings import BATCH, CPUS, TOKENS, Checked, changed_flags, comma_list, setting
from depthscope.probes.config import DataConfig, ExtractionConfig, ProbeConfig

#: the prompt of the lens's token view and of the norms' per-position view and DLA
DEFAULT_PROMPT = "The capital of France is"
#: the token whose logit the report's DLA attributes
DEFAULT_TARGET = " Paris"
#: the most top tokens per position and site in ``lens_tokens`` (three columns each)
MAX_TOP_K = 1000
#: the default prompt pair of ``depthscope patch``: the IOI example of the README
IOI_CLEAN = "When Mary and John went to the store, John gave a drink to"
IOI_CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
#: what a sweep runs on each checkpoint, and the metric it draws by default
ANALYSES = ("lens", "norms", "probe")
DEFAULT_METRIC = {"lens": "kl_to_final", "norms": "stream_norm", "probe": "accuracy"}
#: the sweep settings of the probe analysis, and of the text analyses (lens, norms)
PROBE_FIELDS = ("tasks", "train", "test", "max_train_sentences", "max_test_sentences", "probe")
TEXT_FIELDS = ("text", "max_docs")
ENGINES = ("local", "ray")


@dataclass(frozen=True)
class ModelSpec(Checked):
    """Which model a job runs, where, in what precision, and torch's CPU threads: the ``--model``,
    ``--device``, ``--dtype`` and ``--threads`` options of every command that loads a model."""

    model: str | None = setting(
        None,
        "--model",
        "-m",
        help="Model spec: a folder, a .gguf, a cached hub id, or 'default' (SmolLM2-135M).",
    )
    device: str = setting(
        "cpu", "--device", help="Where the model runs: cpu, cuda, cuda:N, mps, or auto (a GPU when torch sees one)."
    )
    dtype: str = setting(
        "float32",
        "--dtype",
        help="Precision of the model's weights: float32, bfloat16 or float16 (metrics are reduced in float32).",
    )
    threads: int | None = setting(
        None,
        "--threads",
        min=1,
        max=CPUS,
        help="torch CPU threads (default: torch's choice; 1 is often faster on a busy shared machine; at most "
        "4 per CPU).",
    )


@dataclass(frozen=True)
class LensConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.lens.lens_job` computes. ``sites``: labels/indices
    (None: all); ``tuned``: a tuned lens folder to compare with the plain logit lens; ``source``:
    the text's name (figure title). ``window`` is at least 2 tokens (one position and its next token); ``top_k`` at most
    :data:`MAX_TOP_K`. Checked on construction; the fields declare the ``lens`` options."""

    prompt: str = setting(
        DEFAULT_PROMPT, "--prompt", "-p", help="Prompt for the per-token heatmap and rank trajectories."
    )
    sites: Sequence | None = setting(
        None,
        "--sites",
        cli_type=str | None,
        parse=comma_list,
        help="Comma-separated sites (e.g. 'embed,10.attn,29.mlp'); default all.",
    )
    batch_size: int = setting(8, "--batch-size", min=1, max=BATCH, help="Windows per forward pass.")
    window: int | None = setting(
        None,
        "--window",
        min=2,
        help="Tokens per window (default min(context, 512)); longer documents are split.",
    )
    max_tokens: int | None = setting(
        None, "--max-tokens", min=1, help="Stop after this many token positions of the text."
    )
    first_position: bool = setting(
        True,
        "--first-position/--skip-first-position",
        help="Include position 0 of every window (default) or skip it (attention sink).",
    )
    top_k: int = setting(
        5,
        "--top-k",
        min=1,
        max=MAX_TOP_K,
        help=f"Top tokens per position and site in the token table (at most {MAX_TOP_K} and the vocabulary).",
    )
    tuned: Path | None = setting(
        None, "--tuned", help="A tuned lens folder (from lens-train) to compare with the plain logit lens."
    )
    source: str | None = None
    progress: bool = False

    def check(self) -> None:
        """``top_k`` at most :data:`MAX_TOP_K`; a prompt."""
        if self.top_k > MAX_TOP_K:
            raise InputError(f"top_k must be at most {MAX_TOP_K} (three table columns each), got {self.top_k}")
        if not self.prompt:
            raise InputError("the prompt is empty")


@dataclass(frozen=True)
class LensTrainConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.lens.lens_train_job` trains: ``training`` (the
    trainer's settings, :class:`~depthscope.analyses.tuned_lens_config.TunedLensTraining`) and
    ``eval_tokens`` held-out tokens (from the last tenth of the documents) to compare it with the logit lens (0: no
    comparison). Checked on construction; the fields declare the ``lens-train`` options."""

    training: TunedLensTraining = setting(factory=TunedLensTraining)
    eval_tokens: int = setting(
        128,
        "--eval-tokens",
        min=0,
        help="Held-out tokens (the last tenth of the documents) to compare with the logit lens; 0 to skip.",
    )
    progress: bool = True

    def check(self) -> None:
        """The trainer's settings too."""
        self.training.validate()


@dataclass(frozen=True)
class NormsConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.norms.norms_job` computes. ``target``/``contrast``:
    DLA tokens (single-token strings; target None: the model's top prediction); ``heads``: also
    per-head write norms (one more pass); ``source``: the text's name (recorded in the summary).
    Checked on construction; the fields declare the ``norms`` options."""

    prompt: str = setting(
        DEFAULT_PROMPT, "--prompt", "-p", help="Prompt for the per-position heatmap and the DLA bars."
    )
    target: str | None = setting(
        None,
        "--target",
        help="Target token of the DLA, a single token such as ' Paris' (mind the leading space); default: the "
        "model's top prediction.",
    )
    contrast: str | None = setting(
        None, "--contrast", help="Optional contrast token: attribute logit\\[target] - logit\\[contrast]."
    )
    max_tokens: int | None = setting(None, "--max-tokens", min=1, help="Stop after this many real tokens of the text.")
    batch_size: int = setting(4, "--batch-size", min=1, max=BATCH, help="Sequences per forward pass.")
    window: int | None = setting(
        None,
        "--window",
        min=1,
        help="Split documents into windows of at most this many tokens (default min(context, 512)).",
    )
    heads: bool = setting(
        False,
        "--heads",
        help="Also per-head attention write norms over the text (head_writes table and plot; one more pass).",
    )
    progress: bool = False
    source: str | None = None

    def check(self) -> None:
        """A prompt."""
        if not self.prompt:
            raise InputError("the prompt is empty")


@dataclass(frozen=True)
class PatchConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.patch.patch_job` computes: the prompt pair, the
    metric ``logit[target] - logit[foil]`` at the last token (``foil`` None: ``logprob[target]``)
    or a JSONL file of ``pairs`` (each with its own prompts and tokens), the ``method``
    (``activation`` patching, or ``path`` patching from ``senders`` to ``receivers``), the hook
    points (comma-separated names or group words; None: every residual site and every head, see
    :mod:`depthscope.analyses.jobs.patch`), the positions mode (``last`` | ``all`` | ``each`` |
    names of positions the pairs give; None: a default per part), whether to add the attribution
    estimate, the tokens per forward and the figures. Checked on construction; the fields declare
    the ``patch`` options."""

    clean: str = setting(
        IOI_CLEAN, "--clean", help="The clean prompt (default: the IOI example with 'John' as the giver)."
    )
    corrupted: str = setting(
        IOI_CORRUPTED, "--corrupted", help="The corrupted prompt (default: the same with 'Mary' as the giver)."
    )
    target: str = setting(
        " Mary",
        "--target",
        help="Token the clean prompt should predict next, one token (mind the leading space: ' Mary').",
    )
    foil: str | None = setting(
        " John",
        "--foil",
        cli_type=str,
        show=lambda foil: foil or "",
        parse=lambda text: text or None,
        help="Contrast token: the metric is the target's logit minus the foil's at the last token; '' for "
        "the log-probability of the target.",
    )
    pairs: Path | None = setting(
        None,
        "--pairs",
        cli_type=Path | None,
        help="A JSONL file of prompt pairs, one JSON object per line with clean, corrupted, target, foil (and "
        'optional named positions, e.g. "positions": {"S2": 9, "END": -1}): patch every pair and '
        "write the means over pairs (patching.parquet) and the per-pair rows (patching_pairs.parquet).",
    )
    method: str = setting(
        "activation",
        "--method",
        choices=("activation", "path"),
        help="activation: patch each hook point; path: path patching from --senders to --receivers (Wang et al. "
        "2022), every other head frozen at its corrupted value.",
    )
    senders: str = setting(
        "heads",
        "--senders",
        help="Path patching: whose clean output is sent ('heads', '<l>.heads', '<l>.heads.<h>', '<l>.mlp_out', "
        "'<l>.attn_out', residual sites), comma-separated.",
    )
    receivers: str = setting(
        "logits",
        "--receivers",
        help="Path patching: where it is received, patched together: 'logits', or '<l>.q', '<l>.k', '<l>.v' "
        "(every head of layer l, or '<l>.q.<h>' one head) and '<l>.mlp', comma-separated.",
    )
    freeze_mlps: bool = setting(
        False,
        "--freeze-mlps/--recompute-mlps",
        help="Path patching: freeze every MLP at its corrupted value too (with --receivers logits: the direct "
        "effect only); default: MLPs recomputed, as Wang et al.",
    )
    positions: str | None = setting(
        None,
        "--positions",
        help="Token positions to patch: last (the last token), all (every position at once), each (one patch "
        "per position: prompts of the same token length, or the positions each pair names) or names of "
        "positions every pair gives ('S2,END'). Default: each for the residual sites (last when the prompts "
        "differ in token length) and last for the heads; last with --sites; all for --method path.",
    )
    sites: str | None = setting(
        None,
        "--sites",
        help="Comma-separated hook points or group words (e.g. 'embed,10.attn,23.heads' or "
        "'resid,attn_out,mlp_out,heads,z'). Default: every residual site and every attention head "
        "('resid,heads'), as in the README's IOI example.",
    )
    attribution: bool = setting(
        True,
        "--attribution/--no-attribution",
        help="Also the gradient (attribution patching) estimate of every patch, and its rank correlation "
        "with exact patching.",
    )
    batch_tokens: int = setting(
        2048,
        "--batch-tokens",
        min=1,
        max=TOKENS,
        help="Tokens per forward pass (patched rows x recomputed positions).",
    )
    plots: bool = setting(True, "--plots/--no-plots", help="Draw the heatmaps (and the attribution-vs-exact scatter).")

    def check(self) -> None:
        """Both prompts or a pairs file (not both), hook points when ``sites`` is given, and no
        option of the other method."""
        if not self.clean or not self.corrupted:
            raise InputError("the clean and the corrupted prompt must not be empty")
        if self.sites is not None and not str(self.sites).strip(" ,"):
            raise InputError("sites is empty: name hook points or group words, or leave it out for the default")
        if self.positions is not None and not str(self.positions).strip(" ,"):
            raise InputError("positions is empty: last, all, each or position names")
        if self.pairs is not None:
            both = changed_flags(self, ("clean", "corrupted", "target", "foil"))
            if both:
                raise InputError(f"--pairs reads the prompts and tokens from its file: leave out {', '.join(both)}")
            from depthscope.analyses.pairs import read_pairs  # lazy: pandas; every line checked before the model loads

            read_pairs(self.pairs)
        other = ("senders", "receivers", "freeze_mlps") if self.method == "activation" else ("sites",)
        wrong = changed_flags(self, other)
        if wrong:
            raise InputError(f"{', '.join(wrong)} do not apply to --method {self.method}")
        if self.method == "path" and self.positions not in (None, "all", "last"):
            raise InputError(f"--method path patches the senders at all positions or the last: got {self.positions!r}")


def _tasks(help: str) -> object:
    """The ``--task``/``-t`` setting (a comma-separated list of probe tasks) with ``help``."""
    return setting(None, "--task", "-t", param="task", cli_type=str | None, parse=comma_list, help=help)


def _data_file(name: str, what: str) -> object:
    """A ``--train``/``--test``/``--dev`` file setting (None: the default named in ``what``)."""
    return setting(None, f"--{name}", cli_type=Path | None, help=what)


RESUME_HELP = (
    "Reuse what an earlier run in --out finished with the same model, data, settings and depthscope code "
    "(a killed run continues; --no-resume computes everything again, and records it for the next run)."
)


@dataclass(frozen=True)
class ProbeJobConfig(Checked):
    """What the probe job runs: ``tasks`` (None:
    :data:`~depthscope.analyses.jobs.probe.DEFAULT_TASKS`, + entity and coref with GUM-style
    data), ``train`` / ``test`` / ``dev`` files (None: the bundled sample; no
    dev), the settings objects, ``plots``, and ``resume`` (keep each task's tables in the output
    folder as it finishes, and reuse those of a run with the same inputs:
    :mod:`depthscope.common.resume`). Checked on construction (the settings, and that the data
    files exist, before the model loads); the fields declare the ``probe`` options."""

    tasks: Sequence[str] | None = _tasks(
        "Comma-separated tasks: upos, xpos, feats:Number, feats:Tense, ..., deprel, deprel:base, structural, "
        "depth (Hewitt & Manning's structural probes), entity, coref (GUM), or any name with a jiant edge-probing "
        ".jsonl. Default: upos,deprel,feats:Number "
        "(+entity,coref with GUM data)."
    )
    train: str | Path | None = _data_file("train", "Train file (CoNLL-U or jiant .jsonl). Default: the bundled sample.")
    test: str | Path | None = _data_file("test", "Test file (CoNLL-U or jiant .jsonl). Default: the bundled sample.")
    dev: str | Path | None = _data_file(
        "dev", "Dev file, used to choose the L2 penalty per task (--l2 auto); else folds of train."
    )
    probe: ProbeConfig = setting(factory=ProbeConfig)
    extraction: ExtractionConfig = setting(factory=ExtractionConfig)
    data: DataConfig = setting(factory=DataConfig)
    plots: bool = setting(True, "--plots/--no-plots", help="Draw the figures.")
    resume: bool = setting(True, "--resume/--no-resume", help=RESUME_HELP)

    def check(self) -> None:
        """The settings objects, and the data files exist."""
        self.probe.validate()
        self.extraction.validate()
        self.data.validate()
        for name in ("train", "test", "dev"):
            p = getattr(self, name)
            if isinstance(p, (str, Path)) and not Path(p).is_file():
                raise InputError(f"--{name}: no such file: {p}")


@dataclass(frozen=True)
class SweepJobConfig(Checked):
    """``analysis`` (lens, norms or probe) on every checkpoint. lens/norms read ``text`` (a file, one
    document per line; default the bundled EWT sample's text), at most ``max_docs`` documents;
    probe reads ``train``/``test`` (default the bundled EWT sample) for ``tasks``, with ``probe``
    (the :class:`ProbeConfig` of ``depthscope probe`` / ``run_probes``: the same protocol and
    defaults). ``metric``: the column drawn across checkpoints (default per analysis, ``DEFAULT_METRIC``).
    ``engine``: ``local`` (one checkpoint after another) or ``ray`` (the :class:`RayEngine` ``ray``).
    Checked on construction; the fields declare the ``sweep`` options."""

    analysis: str = setting("lens", "--analysis", "-a", help="lens | norms | probe")
    text: Path | None = setting(
        None, "--text", help="Plain text for lens/norms (one document per line); default: the bundled EWT sample."
    )
    max_docs: int = setting(200, "--max-docs", min=1, help="Use at most this many documents of --text.")
    tasks: Sequence[str] = setting(
        ("upos",),
        "--task",
        param="task",
        cli_type=str,
        show=",".join,
        parse=lambda text: tuple(comma_list(text) or ()),
        help="Probe tasks, comma-separated (probe).",
    )
    train: Path | None = setting(None, "--train", help="CoNLL-U/JSONL train file (probe); default: bundled EWT sample.")
    test: Path | None = setting(None, "--test", help="CoNLL-U/JSONL test file (probe); default: bundled EWT sample.")
    max_train_sentences: int | None = setting(
        None, "--max-train-sentences", min=1, help="Cap probe train data at N sentences (probe)."
    )
    max_test_sentences: int | None = setting(
        None, "--max-test-sentences", min=1, help="Cap probe test data at N sentences (probe)."
    )
    probe: ProbeConfig = setting(factory=ProbeConfig)
    metric: str | None = setting(
        None, "--metric", help="Metric for the checkpoint x depth heatmap (default per analysis)."
    )
    allow_mixed: bool = setting(
        False, "--allow-mixed", help="Allow checkpoints of different architectures or tokenizers."
    )
    overwrite: bool = setting(False, "--overwrite", help="Replace another sweep's results in --out.")
    engine: str = setting(
        "local",
        "--engine",
        choices=ENGINES,
        help="local (one checkpoint after another) or ray (one Ray task per checkpoint).",
    )
    ray: RayEngine = setting(factory=RayEngine)

    def check(self) -> None:
        """A known analysis, the probe settings, no setting of another analysis (none is silently
        ignored), Ray settings only with ``engine="ray"``, and Ray installed for it."""
        if self.analysis not in ANALYSES:
            raise InputError(f"--analysis must be one of {', '.join(ANALYSES)}, not {self.analysis!r}")
        self.probe.validate()
        wrong = changed_flags(self, TEXT_FIELDS if self.analysis == "probe" else PROBE_FIELDS)
        if wrong:
            needs = "--analysis lens or norms" if self.analysis == "probe" else "--analysis probe"
            raise InputError(f"{', '.join(wrong)} only apply to {needs} (this sweep runs {self.analysis})")
        if self.engine == "local" and (self.ray.address is not None or self.ray.gpus_per_task):
            raise InputError("--address and --gpus-per-task need --engine ray")
        if self.engine == "ray":
            require_ray()  # refused before any work when Ray is not installed


@dataclass(frozen=True)
class ReportConfig(Checked):
    """What ``depthscope run`` runs: the model (None: the embedded default), the probe data files
    (None: the bundled EWT sample), the running text for the lens and norms (None: the probe
    data's text, capped at ``lens_tokens`` / ``norms_tokens``), the prompt and DLA target,
    the probe job's settings, ``causal`` (the causal section on ``causal_tokens`` tokens), and
    ``resume`` (reuse the stages an earlier run in the folder finished with the same inputs).
    Checked on construction; the fields with a flag declare ``run`` options (the model's are
    :class:`ModelSpec`'s, the data files and the text ``run``'s own)."""

    model: str | None = None
    device: str = "cpu"  # cpu, cuda, cuda:N, mps, auto
    dtype: str = "float32"  # float32, bfloat16, float16
    train: str | None = None
    test: str | None = None
    dev: str | None = None
    texts: Sequence[str] | None = None
    tasks: Sequence[str] | None = _tasks(
        "Probe tasks, comma-separated (default: upos,deprel,feats:Number; +entity,coref with GUM data)."
    )
    prompt: str = setting(DEFAULT_PROMPT, "--prompt", help="Prompt for the per-token views and DLA.")
    target: str = setting(DEFAULT_TARGET, "--target", help="Target token for DLA.")
    lens_tokens: int = setting(1500, "--lens-tokens", min=1, help="Tokens of text for the logit lens.")
    norms_tokens: int = setting(4000, "--norms-tokens", min=1, help="Tokens of text for contribution norms.")
    causal: bool = setting(
        False,
        "--causal/--no-causal",
        help="Also the 'Encoded vs used' section: LEACE erasure of each word task at every site, its effect on "
        "probes and on the model's loss (1 + 3 forward passes per site and task over --causal-tokens tokens).",
    )
    causal_tokens: int = setting(
        1000, "--causal-tokens", min=1, help="Held-out tokens (test sentences) for the causal section's loss."
    )
    resume: bool = setting(True, "--resume/--no-resume", help=RESUME_HELP)
    # the probe section's settings: the same objects, with the same defaults, as `depthscope probe`
    probe: ProbeConfig = setting(factory=ProbeConfig)
    extraction: ExtractionConfig = setting(factory=ExtractionConfig)
    data: DataConfig = setting(factory=DataConfig)


@dataclass(frozen=True)
class LayersConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.layers.layers_job` computes: every block skipped and
    every pair of neighbouring blocks swapped, scored on the text (``source``: its name, recorded
    in the summary). Checked on construction; the fields declare the ``layers`` options."""

    batch_size: int = setting(4, "--batch-size", min=1, max=BATCH, help="Lines per forward pass.")
    window: int | None = setting(
        None,
        "--window",
        min=2,
        help="Split lines into windows of at most this many tokens (default min(context, 512)).",
    )
    max_docs: int | None = setting(None, "--max-docs", min=1, help="Use only the first this many lines of the text.")
    progress: bool = False
    source: str | None = None


@dataclass(frozen=True)
class CacheConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.cache.cache_job` writes: the hook ``points`` (``resid``:
    the 2L+1 residual sites; else a comma list of point names) of every token of the text, into an
    activation cache (:mod:`depthscope.hooks.activation_cache`), ``chunk_tokens`` padded tokens
    per forward pass and chunk. Checked on construction; the fields declare the ``cache`` options."""

    points: str = setting(
        "resid", "--points", help="Hook points: 'resid' (every residual site) or a comma list (e.g. '0.mlp,5.z')."
    )
    chunk_tokens: int = setting(
        1024, "--chunk-tokens", min=1, max=TOKENS, help="Padded tokens per forward pass and per chunk written."
    )
    max_docs: int | None = setting(None, "--max-docs", min=1, help="Use only the first this many lines of the text.")
    progress: bool = False

    def check(self) -> None:
        """Some points."""
        if not comma_list(self.points):
            raise InputError("--points is empty: give 'resid' or a comma list of hook points")
