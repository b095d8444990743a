"""Tenney et al. (2019)'s two summaries: scalar mixing weights and cumulative scoring.

Scalar mix (``E_s``): a probe reads ``gamma * sum_s s_s x_s`` over all sites, the weights ``s``
on the simplex (Tenney's softmax weights), trained jointly with them; the *expected layer* of the mix is
``E_s = sum_s depth(s) * s_s``. The sites' features are standardised, but a mix of them is not:
``var(sum_s s_s x_s) = s^T C s`` is below 1 inside the simplex unless the sites are perfectly
correlated, so with ``gamma`` fixed at 1 every spread mix hands the probe *smaller* features,
which the L2 penalty on the probe's weights charges for, and the penalised optimum is pushed to
a vertex: one site, E_s at an integer or half-integer depth (the penalty's artefact, not the
data's; ``docs/tenney_comparison.md``, Scalar mix, measures it). :func:`fit_mix` therefore sets
``gamma = 1 / sqrt(mean_d var(mix_d))`` on train at every step (``normalise=True``): every mix
reaches the probe at the scale of one standardised site, the penalty sees the same features'
scale wherever the weights are, and a one-site mix is unchanged (gamma 1). It is Tenney's
trainable ``gamma`` held at the value that makes the penalty scale-neutral (a free, unpenalised
``gamma`` would grow without end against the penalised weights). The weights are fitted on the
simplex itself (SLSQP, from several starts: :func:`fit_mix`), so the mix found is the optimum to
the fit's tolerance on any CPU: over softmax logits, whose gradient vanishes at a vertex, the fit
could stop at one where the kernels rounded it there. :func:`mix_draws` refits the mix without
each fold of train, for an interval of E_s and the spread of the weights.

Cumulative scoring (``E_Delta``): ``P(s)`` predicts from sites ``0..s``;
``Delta(s) = score(P(s)) - score(P(s-1))`` is what site ``s`` adds, and the *expected layer*
of the gains is ``E_Delta = sum_{s>=1} depth(s) * Delta(s) / sum_{s>=1} Delta(s)``.

The score is the *soft accuracy*: the mean probability ``P(s)`` gives the gold label on test
(the expected accuracy of a label drawn from the probe's prediction). Tenney scored the argmax
(accuracy, F1); that hard score is kept beside it (``CumulativeFit.accuracy``, the summary's
``expected_layer_delta_hard``) but is not the headline, because E_Delta sums the gap between
each late prefix and the last one over every late site (``E_Delta = sum_{s<S-1} (1 - g(s))``
in sites, ``g`` the fraction of the total gain prefix ``s`` reaches), so a few test words
flipping between two nearly equal prefixes move the hard E_Delta by a large fraction of a
block, while the soft score changes smoothly with the probabilities
(``docs/tenney_comparison.md``, Stability, measures both).

``P(s)`` here is a *convex* cumulative probe, not Tenney's jointly trained prefix mix: it
combines the converged per-site probes of sites ``0..s``, ``logits = sum_{t<=s} w_t log p_t(y|x)
+ b`` (stacking; Wolpert 1992), with ``w, b`` fitted on out-of-fold predictions of train
(``ProbeConfig.stack_folds`` folds: the per-site probes are refitted without the fold they
predict) and a ridge ``ProbeConfig.stack_l2`` on ``w``. Why: the prefix-mix objective is not
convex in the mixing weights, so its E_Delta depends on how long training runs; the stacked
``P(s)`` is the unique optimum of a convex problem, so once every probe has converged the epoch
cap does not move E_Delta. What remains is the fold draw: which train examples the fold probes
leave out moves the stacking weights a little, and the test accuracy of the late prefixes (each
flip of one test word) a little more; E_Delta weighs those late accuracies by their depth, and
the last prefix's accuracy is also the total gain that normalises it, so one draw's E_Delta is
noisy. The stacking is therefore repeated on ``ProbeConfig.stack_draws`` fold draws (each draw
refits every per-site probe on each fold), the scores of ``P(s)`` are means over draws, and the
interval resamples the draws with the test examples, so it covers the draws' spread. The
stacking ridge is a setting, not a fitted value: a stronger ridge spreads each prefix's weight
over more sites, which raises the late prefixes' hard accuracy and the hard E_Delta (the soft
one barely moves), and cross-validation on train's out-of-fold predictions cannot tell the
values apart. It keeps Tenney's question (how much better can the property be predicted once
site ``s`` is available) and scores on test like every other probe. Depth is in block units
(embed 0, ``l.attn`` l + 0.5, ``l.mlp`` l + 1), so the numbers compare with Tenney's layer
numbers; relative depth = E / n_layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from depthscope.common.errors import InputError
from depthscope.common.runtime import release_memory
from depthscope.probes.config import ProbeConfig, override
from depthscope.probes.metrics import macro_f1
from depthscope.probes.solvers.classifiers import numeric_l2, site_probe
from depthscope.probes.solvers.lbfgs import newton
from depthscope.probes.solvers.training import TrainLog, log_probs, train_kwargs, train_probe
from depthscope.probes.store.features import Features
from depthscope.probes.store.site_sums import site_inner, weighted_sum
from depthscope.probes.store.span_rows import SpanRows

#: the default ridge on the stacking weights (``ProbeConfig.stack_l2``): adjacent sites' predictions are nearly
#: collinear, and the ridge spreads the weight among them (steadier weights from one fold draw to the next)
STACK_L2 = ProbeConfig.stack_l2
#: Newton iterations the stacking may take (each: one Hessian per prefix, about S^3 N C / 3 products)
STACK_MAX_ITERS = 50
#: SLSQP iterations over the mixing weights one start of a scalar mix may take (each: two products
#: with every site's features and one warm-started probe solve, and a few more in its line search)
MIX_MAX_ITERS = 300
#: starts of a scalar mix fitted from scratch (the uniform mix, then seeded random mixes): on the bundled
#: sample's three tasks a second start ended at the same mix (E_s within 0.007 block), so one is the default
MIX_STARTS = 1
#: the largest probe-gradient entry at which a mix counts as converged (each probe solve stops at a tenth)
MIX_GTOL = 1e-4
#: the largest simplex gap (:func:`simplex_gap`, in the objective's gradient per unit weight) at which a mix
#: counts as converged
MIX_GAP = 1e-4
#: how often one start's SLSQP may begin afresh when it stops before the convergence test holds
MIX_RESTARTS = 4
#: SLSQP's precision goal for the objective (summed in float64; the optimum is flat to about 1e-8)
MIX_FTOL = 1e-10
#: a weight below this is 0 (a site the mix does not use)
MIX_ZERO = 1e-9
#: ends of two starts whose objectives are this close are one optimum to the objective's resolution (the
#: float32 mix rounds differently for each split of weight between two equal sites: 1e-8 apart), and
#: the earlier start's end is kept, whichever rounds lower
MIX_FNOISE = 1e-7
#: objectives this close count as tied optima, and weights this far apart as different mixes (:func:`fit_mix`'s note)
MIX_FTIE, MIX_WTOL = 1e-6, 0.02
#: examples per chunk of the stacking objective (its float64 workspace: two ``[S, chunk, C]`` buffers)
STACK_CHUNK = 1024
#: bytes of the fold copy of resident features the out-of-fold refits hold at a time (sites in runs)
OOF_BYTES = 2.5e8
#: L-BFGS iterations the probe of one mix may take (warm-started from the previous mix's probe)
PROBE_MAX_ITERS = 500


def deltas(scores) -> np.ndarray:
    """``Delta(s) = score(s) - score(s-1)``, with ``Delta(0) = score(0)`` (along the first axis:
    ``scores`` is ``[S]`` or ``[S, k]``, k score profiles side by side)."""
    s = np.asarray(scores, dtype=np.float64)
    return np.diff(s, axis=0, prepend=np.zeros((1,) + s.shape[1:]))


def expected_layer_delta(depths: Sequence[float], scores):
    """Tenney's ``E_Delta``: the Delta-weighted mean depth over sites ``s >= 1`` (NaN when
    the gains sum to zero). ``scores [S]`` gives a float; ``scores [S, k]`` an array of k."""
    d = np.asarray(depths, dtype=np.float64)[1:]
    g = deltas(scores)[1:]
    if len(g) == 0:
        return float("nan")
    tot = g.sum(0)
    ok = np.abs(tot) >= 1e-12
    e = np.where(ok, (d.reshape((-1,) + (1,) * (g.ndim - 1)) * g).sum(0) / np.where(ok, tot, 1.0), np.nan)
    return float(e) if g.ndim == 1 else e


def expected_layer_mix(depths: Sequence[float], weights):
    """``E_s = sum depth * s`` for softmax mixing weights ``s [S]`` (renormalised): a float; for
    ``weights [K, S]`` (K mixes, e.g. :func:`mix_draws`) an array of K."""
    w = np.asarray(weights, dtype=np.float64)
    e = (w * np.asarray(depths, dtype=np.float64)).sum(-1) / w.sum(-1)
    return float(e) if w.ndim == 1 else e


def mix_spread(weights) -> float:
    """The spread of mixing weights ``s [S]`` in sites: ``exp(entropy)``, the number of equally
    weighted sites with the same entropy (1: all weight on one site; S: uniform)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w[w > 0] / w.sum()
    return float(np.exp(-(w * np.log(w)).sum()))


def expected_layer_delta_interval(
    depths: Sequence[float], correct, *, n_boot: int = 1000, level: float = 0.95, seed: int = 0
) -> tuple:
    """A bootstrap interval for ``E_Delta``: ``correct [S, N]`` is prefix probe ``P(s)``'s score
    on test example ``n`` (1/0: right or not; or the soft score, the probability of the gold
    label), ``correct [R, S, N]`` the same for each of ``R`` fold draws (the point estimate then
    uses their mean). Each resample reweights the test
    examples (Poisson(1) weights, all prefixes at once as one matrix product) and, with draws,
    resamples the draws too (with replacement: a two-level bootstrap), then recomputes the
    cumulative accuracies and ``E_Delta``. Returns ``(low, high)``; NaN when undefined.

    It covers which test examples were drawn and, with ``R > 1``, the fold draws' spread (the
    training randomness left once every probe is converged); when the total gain ``sum Delta``
    is small against the noise of the individual ``Delta(s)``, the interval is wide and
    ``E_Delta`` should not be read as a depth."""
    c = torch.as_tensor(np.asarray(correct), dtype=torch.float32)
    if c.dim() == 2:
        c = c[None]
    R, S, N = c.shape
    if N == 0 or S < 2:
        return float("nan"), float("nan")
    g, g_draws = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    vals = []
    for a in range(0, n_boot, 250):
        k = min(250, n_boot - a)
        w = torch.poisson(torch.ones(k, N), generator=g)  # [k, N]
        pick = torch.randint(R, (k, R), generator=g_draws)
        m = torch.zeros(k, R).scatter_add_(1, pick, torch.ones(pick.shape)) / pick.shape[1]  # [k, R] draw weights
        hits = torch.einsum("kr,rsk->sk", m, c @ w.T)  # [S, k] weighted correct counts, draws mixed
        acc = hits / w.sum(1).clamp_min(1)  # [S, k] cumulative accuracies per resample
        vals.append(expected_layer_delta(depths, acc.double().numpy()))
    v = np.concatenate(vals)
    v = v[np.isfinite(v)]
    if len(v) < n_boot // 2:
        return float("nan"), float("nan")
    q = (1 - level) / 2
    return float(np.quantile(v, q)), float(np.quantile(v, 1 - q))


@dataclass
class CumulativeFit:
    accuracy: np.ndarray  # [S] test accuracy of P(s) (argmax right), mean over the fold draws
    macro_f1: np.ndarray  # [S] mean over the fold draws
    weights: np.ndarray  # [S, S] stacking weights of P(s), mean over the draws (row s: sites 0..s; zeros above)
    mix: np.ndarray  # [S] the all-sites scalar mix's weights (E_s)
    correct: np.ndarray = None  # [R, S, N] bool: P(s) of fold draw r right on test example n (for intervals)
    log: object = None  # TrainLog of the stacking (convergence per prefix, all draws)
    mix_log: object = None  # TrainLog of the scalar mix
    soft: np.ndarray = None  # [R, S, N] float32: the probability P(s) of fold draw r gives test example n's label
    mix_draws: np.ndarray = None  # [K, S]: the scalar mix refitted without each fold of train (None: not fitted)

    @property
    def score_draws(self) -> np.ndarray:
        """``[R, S, N]``: each fold draw's per-example score E_Delta is computed from: the soft
        score (module docstring), or 1/0 right when no probabilities were kept."""
        return self.correct if self.soft is None else self.soft

    @property
    def score_mean(self) -> np.ndarray:
        """``[S, N]``: the per-example score of ``P(s)``, mean over the fold draws."""
        return np.asarray(self.score_draws, dtype=np.float64).mean(0)

    @property
    def score(self) -> np.ndarray:
        """``[S]``: the cumulative score of ``P(s)`` (the soft accuracy), mean over the fold draws."""
        return self.score_mean.mean(1)

    @property
    def soft_accuracy(self) -> np.ndarray:
        """``[S]``: the mean probability ``P(s)`` gives the gold label (= :attr:`score`)."""
        return self.score

    @property
    def delta(self) -> np.ndarray:
        return deltas(self.score)

    @property
    def mix_weights(self) -> np.ndarray:
        """The all-sites scalar mix."""
        return self.mix

    @property
    def gamma(self) -> np.ndarray:
        """Ones: the mix's scale is folded into its probe (:func:`fit_mix`), the weights are the mix."""
        return np.ones(len(self.accuracy))

    def mix_range(self, depths: Sequence[float]) -> tuple[float, float]:
        """The lowest and highest E_s of the mixes refitted without one fold of train
        (:attr:`mix_draws`); NaN when none were fitted."""
        if self.mix_draws is None or len(self.mix_draws) == 0:
            return float("nan"), float("nan")
        e = expected_layer_mix(depths, self.mix_draws)
        return float(e.min()), float(e.max())


def gold_probability(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[..., N]``: the softmax probability of label ``y [N]`` under ``logits [..., N, C]``; 0 for
    a label the probe has no class for (``y >= C``: seen only in test)."""
    C = logits.shape[-1]
    lp = torch.log_softmax(logits.double(), -1)
    idx = y.clamp(max=C - 1).expand(lp.shape[:-1])[..., None]
    return torch.where(y < C, lp.gather(-1, idx).squeeze(-1).exp(), 0.0).float()


def out_of_fold(
    train: Features,
    y_train,
    *,
    n_classes: int,
    cfg: ProbeConfig,
    folds: int | None = None,
    init: dict | None = None,
    draw: int = 0,
    desc: str = "",
) -> torch.Tensor:
    """Log-probabilities ``[S, N, C]`` of each train example under per-site probes (penalty
    ``cfg.l2``) trained on the other ``folds`` folds (None: ``cfg.stack_folds``); the folds are
    fold draw ``draw`` of ``cfg.seed``;
    ``init``: a state dict to start each fold's probes from (the full-train probes: near each
    fold's optimum, so few passes)."""
    n, S = len(train), train.n_sites
    folds = cfg.stack_folds if folds is None else folds
    if n < folds:
        raise InputError(f"stack_folds={folds} needs at least {folds} train examples, got {n}")
    fold = np.random.default_rng([cfg.seed, 1729, draw]).permutation(n) % folds
    out = torch.empty(S, n, n_classes)
    y = np.asarray(y_train)
    for k in range(folds):
        tr, ho = np.flatnonzero(fold != k), np.flatnonzero(fold == k)
        for sites in _site_blocks(train, len(tr), cfg):
            part = train if sites == slice(0, S) else train.with_sites(np.arange(sites.start, sites.stop))
            ftr = part.subset(tr, seed=cfg.seed)
            p = site_probe(part, n_classes, cfg)
            if init is not None:
                p.load_state_dict(init if part is train else _state_of_sites(init, sites))
            yk = torch.as_tensor(y[tr])[:, None]
            train_probe(p, ftr, yk, **train_kwargs(cfg), desc=f"{desc}fold {k + 1}/{folds}")
            del ftr  # one copy at a time: the held-out rows are copied once the probes are fitted
            out[sites, torch.from_numpy(ho)] = log_probs(p, part.subset(ho, seed=cfg.seed))[:, :, 0]
    return out


def _state_of_sites(state: dict, sites: slice) -> dict:
    """A linear per-site probe's state dict (``W [S, F, C]``, ``b [S, 1, C]``, ``l2``) at ``sites``."""
    return {name: v[sites] if name in ("W", "b") else v for name, v in state.items()}


def _site_blocks(train: Features, n_rows: int, cfg: ProbeConfig) -> list:
    """The runs of sites the out-of-fold refits fit one after another, so that a fold's copy of
    resident features holds at most :data:`OOF_BYTES` (each site's linear probe is its own
    problem: the blocks change no fit); one run of every site for streamed features, a subset of
    the store's sites or MLP probes."""
    S = train.n_sites
    if train.resident is None or train.sites is not None or cfg.probe != "linear":
        return [slice(0, S)]
    per_site = n_rows * train.resident.shape[2] * train.resident.element_size()
    k = max(1, int(OOF_BYTES // max(per_site, 1)))
    return [slice(a, min(S, a + k)) for a in range(0, S, k)]


def stack(
    z_train: torch.Tensor,
    y_train,
    *,
    l2: float = STACK_L2,
    max_iters: int = STACK_MAX_ITERS,
    tol=1e-7,
    init: tuple | None = None,
    reuse: float = 1e-4,
):
    """Stacking weights of every prefix: ``(w [S, S] lower-triangular, b [S, C], TrainLog)``
    minimising ``mean CE(sum_{t<=s} w_st z_t + b_s) + l2 * ||w_s||^2`` for each ``s``, from
    ``w_s = e_s`` (``P(s)`` starts as site ``s``'s own probe), or from ``init = (w, b)`` (another
    fold draw's solution: near this one's, so fewer iterations). ``z_train [S, N, C]``.

    Each prefix is a small convex problem (at most ``S + C`` parameters), solved by Newton's
    method (:func:`~depthscope.probes.solvers.lbfgs.newton`) with the Hessian
    (:func:`_stack_hessian`): adjacent sites' predictions are nearly collinear, an
    ill-conditioned problem on which first-order methods crawl, while Newton's steps are
    unaffected by the conditioning. The objective and gradient are float64 and use every
    example; the Hessian only steers the step, so it is formed from every other example (above
    4096: a sample of the rows, as the subspace solver's Newton system) and a prefix whose last
    step was a full one with a relative decrease of at most ``reuse`` keeps its Hessian for the
    next step (``newton``'s ``reuse_below``: the stopping rule's last iterations, at the optimum,
    cost no Hessian). Neither changes the optimum, only the iterations to it."""
    S, n, C = z_train.shape
    mask = torch.tril(torch.ones(S, S, dtype=torch.float64))
    fg = _stack_objective(z_train, y_train, mask, l2)
    w0, b0 = init if init is not None else (torch.eye(S), torch.zeros(S, C))
    x0 = torch.cat([w0, b0], 1).double()
    # the Hessian (it only steers the step) from every other example: half its cost, a step or two more
    z_hess = z_train[:, ::2].contiguous() if n >= 2 * 2048 else z_train
    sol = newton(
        fg,
        lambda x, units: _stack_hessian(z_hess, x, l2, units=units),
        x0,
        max_iters=max_iters,
        ftol=tol,
        gtol=1e-4,
        reuse_below=reuse,
    )
    log = TrainLog.from_solved("newton", sol, max_iters)  # newton stops early only when every prefix converged
    return (sol.x[:, :S] * mask).float(), sol.x[:, S:].float(), log


def _stack_objective(z_train: torch.Tensor, y_train, mask: torch.Tensor, l2: float, chunk: int = STACK_CHUNK):
    """The stacking objective of every prefix for :func:`newton`: ``fg(x, active) -> (f [S],
    grad [S, S + C])`` at ``x [S, S + C]`` (weights masked by ``mask``, then biases), computed for
    the ``active`` prefixes only (zero elsewhere), analytically: one ``[A, S] x [S, B C]``
    product each way per chunk of ``chunk`` examples, in float64 (cheap here, and no float32
    floor on the tolerance). The chunks bound the workspace to two float64 ``[S, chunk, C]``
    buffers, made once and reused by every chunk and call (the predictions' float64 copy and
    the prefixes' logits, turned in place into log-probabilities and then into the residuals
    ``softmax - onehot``): all the prefixes' logits at once would be several ``[S, N, C]``
    float64 buffers (0.7 GB for deprel on the bundled sample), and a fresh buffer per chunk
    leaves the heap holding several."""
    S, n, C = z_train.shape
    y = torch.as_tensor(np.asarray(y_train), dtype=torch.long)
    chunk = min(chunk, n)
    zbuf = torch.empty(S * chunk * C, dtype=torch.float64)
    lbuf = torch.empty(S * chunk * C, dtype=torch.float64)
    minus_one = torch.full((S, chunk, 1), -1.0, dtype=torch.float64)

    def fg(x, active):
        rows = torch.nonzero(active)[:, 0]
        A = len(rows)
        w, b = x[rows, :S] * mask[rows], x[rows, S:]
        ce = torch.zeros(A, dtype=torch.float64)
        gw, gb = torch.zeros(A, S, dtype=torch.float64), torch.zeros(A, C, dtype=torch.float64)
        for a in range(0, n, chunk):
            B = min(chunk, n - a)
            zc = zbuf[: S * B * C].view(S, B * C)
            zc.view(S, B, C).copy_(z_train[:, a : a + B])
            logp = torch.mm(w, zc, out=lbuf[: A * B * C].view(A, B * C)).view(A, B, C).add_(b[:, None])
            logp.sub_(torch.logsumexp(logp, -1, keepdim=True))  # log_softmax in place
            target = y[a : a + B].expand(A, -1)[..., None]
            ce -= logp.gather(2, target).squeeze(2).sum(1)
            r = logp.exp_().scatter_add_(2, target, minus_one[:A, :B])
            gw += r.view(A, -1) @ zc.T  # d sum CE / d w: (softmax - onehot) times the predictions
            gb += r.sum(1)
        f = torch.zeros(S, dtype=torch.float64)
        f[rows] = ce / n + l2 * (w * w).sum(1)
        g = torch.zeros(S, S + C, dtype=torch.float64)
        g[rows, :S] = gw / n * mask[rows] + 2.0 * l2 * w
        g[rows, S:] = gb / n
        return f, g

    return fg


@torch.no_grad()
def _stack_hessian(
    z: torch.Tensor, x: torch.Tensor, l2: float, *, units: torch.Tensor | None = None, chunk: int = 256
) -> torch.Tensor:
    """The stacking objective's Hessian for the prefixes ``units`` (indices; None: all)
    ``[len(units), S + C, S + C]`` at ``x [S, S + C]`` (weights, then biases). With ``p`` the
    prefix's softmax and ``m_t = sum_c p_c z_tc`` per example:
    ``H_ww[t, t'] = mean(sum_c p_c z_tc z_t'c - m_t m_t') + 2 l2 [t = t']``,
    ``H_wb[t, c] = mean(p_c (z_tc - m_t))``, ``H_bb = mean(diag(p) - p p^T)``; rows and columns of
    the sites a prefix cannot use are the identity. Float32 products (it only steers the step),
    summed over chunks of ``chunk`` examples: the prefixes' softmax in one product, the
    ``m``, ``H_wb`` and ``H_bb`` terms as batched products over the prefixes, and the
    ``sum_c p_c z_tc z_t'c`` term one product per prefix over its own sites only. Small chunks
    keep the temporaries small (about a dozen ``[S, chunk, C]`` buffers, 0.2 GB at 2048 examples
    for deprel on the bundled sample) at no cost in time: the products stay in cache."""
    S, n, C = z.shape
    units = torch.arange(S) if units is None else torch.as_tensor(units, dtype=torch.long)
    U = len(units)
    z = z.float()
    mask = torch.tril(torch.ones(S, S))[units]  # [U, S]: site t usable by prefix units[i]
    w, b = x[units, :S].float() * mask, x[units, S:].float()
    hww, hwb, hbb = torch.zeros(U, S, S), torch.zeros(U, S, C), torch.zeros(U, C, C)
    for a in range(0, n, chunk):
        zc = z[:, a : a + chunk]  # [T, B, C]
        B = zc.shape[1]
        p = torch.softmax((w @ zc.reshape(S, B * C)).view(U, B, C) + b[:, None], -1)  # [U, B, C]
        m = torch.bmm(p.transpose(0, 1), zc.permute(1, 2, 0)).permute(1, 2, 0)  # [U, T, B]: m[i, t] = sum_c p_i z_t
        hww -= torch.bmm(m, m.transpose(1, 2))
        hwb += torch.bmm(p.permute(2, 0, 1), zc.permute(2, 1, 0)).permute(1, 2, 0) - torch.bmm(m, p)
        hbb += torch.diag_embed(p.sum(1)) - torch.bmm(p.transpose(1, 2), p)
        ps = p.sqrt()
        for i, s in enumerate(units.tolist()):
            zp = (zc[: s + 1] * ps[i]).reshape(s + 1, B * C)
            hww[i, : s + 1, : s + 1] += zp @ zp.T
    hww /= n
    hww.diagonal(dim1=1, dim2=2).add_(2.0 * l2)
    keep = mask.bool()  # [i, t]: site t usable by prefix units[i]
    pair = keep[:, :, None] & keep[:, None, :]
    H = torch.zeros(U, S + C, S + C)
    H[:, :S, :S] = torch.where(pair, hww, torch.eye(S).expand(U, S, S))
    H[:, :S, S:] = hwb / n * keep[..., None]
    H[:, S:, :S] = H[:, :S, S:].transpose(1, 2)
    H[:, S:, S:] = hbb / n
    return H


def apply_stack(w: torch.Tensor, b: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Logits ``[S, N, C]`` of every prefix probe from per-site log-probabilities ``z [S, N, C]``."""
    S, n, C = z.shape
    return (w @ z.reshape(S, n * C)).view(S, n, C) + b[:, None]


@dataclass
class MixFit:
    """A scalar mix fitted by :func:`fit_mix`: ``weights [S]`` (on the simplex), ``gamma`` (the
    scale that made the mix unit-scale on train; 1 without normalising), the final ``objective``,
    whether it ``converged`` (:func:`fit_mix`'s test) and the
    ``iterations`` taken (all starts)."""

    weights: np.ndarray
    gamma: float
    objective: float
    converged: bool
    iterations: int
    grad_max: float = float("nan")
    state: tuple = None  # (a, W, b) tensors, to warm-start another fit (a: log weights)
    optima: list = None  # every start's end: (weights [S], objective)
    note: str = ""  # two optima the data cannot tell apart (fit_mix), else empty


class _FlatSites:
    """Resident features ``X [S, N, F]`` as ``[S, F * N]`` (feature-major: a view), with the
    scalar mix's two passes over them (:class:`~depthscope.probes.store.span_rows.SpanRows` has
    the same two for span rows)."""

    def __init__(self, X: torch.Tensor):
        S, N, F_ = self.shape = X.shape
        self.Xf = X.transpose(1, 2).reshape(S, F_ * N)
        self.F, self.N = F_, N

    def mix(self, p: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_s p_s X_s`` as ``[F, N]`` float32 (into ``out`` when given)."""
        return weighted_sum(self.Xf, p, None if out is None else out.view(-1)).view(self.F, self.N)

    def mix_grad(self, D: torch.Tensor) -> torch.Tensor:
        """``<X_s, D>`` per site ``[S]`` (float32) for ``D [F, N]``."""
        return site_inner(self.Xf, D.reshape(-1))


def _sites(X) -> _FlatSites | SpanRows:
    """The scalar mix's view of resident features (span rows are read as they are)."""
    return X if isinstance(X, SpanRows) else _FlatSites(X)


def _probe_solve(u: torch.Tensor, yt: torch.Tensor, W: torch.Tensor, b: torch.Tensor, l2: float) -> tuple:
    """The penalised linear probe on fixed features ``u [F, N]`` (feature-major), from ``(W, b)``:
    ``argmin mean CE(u^T W + b) + l2 ||W||^2`` by full-batch L-BFGS to :data:`MIX_GTOL` / 10 (a
    convex problem of ``F x C`` weights; a warm start from the previous mix's probe takes a few
    steps). Returns the detached ``(W, b)``."""
    W, b = W.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    opt = torch.optim.LBFGS(
        [W, b],
        max_iter=PROBE_MAX_ITERS,
        history_size=20,
        tolerance_grad=MIX_GTOL / 10,
        tolerance_change=1e-14,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        # float64 sums: a float32 loss stops L-BFGS (its change reads 0) with the gradient still 1e-4
        f = torch.nn.functional.cross_entropy(torch.addmm(b, u.T, W).double(), yt) + l2 * W.double().square().sum()
        f.backward()
        return f

    opt.step(closure)
    return W.detach(), b.detach()


class _ProjectedMix:
    """The scalar-mix objective as a function of the mixing weights ``p`` alone (variable
    projection): ``g(p) = min_{W, b} f(p, W, b)``, the probe solved at each ``p``
    (:func:`_probe_solve`, warm-started from the last one). By the envelope theorem
    ``dg/dp = df/dp`` at the solved probe, so one evaluation reads the features twice (the mix,
    then the gradient of its S weights) however many probe weights there are, and the outer
    problem has S unknowns instead of ``S + F C``.

    The gradient is written out rather than left to autograd, so that an evaluation allocates
    nothing of the mix's size: the mix ``m``, the scaled mix ``u = gamma m`` and ``df/dm`` live
    in three ``[F, N]`` float32 buffers made once (autograd would make half a dozen temporaries
    of that size per evaluation, 37 MB each for deprel, and their reuse fragments the heap). With
    ``Z = u^T W + b`` and ``G = (softmax(Z) - Y) / N``: ``D = df/du = W G^T``, and through
    ``gamma = (mean_f var_n m)^(-1/2)``, ``df/dm = gamma D - (gamma^3 / (F N)) <D, m> (m - mean_n m)``;
    ``df/dp_s = <X_s, df/dm>``."""

    def __init__(self, sites, y: torch.Tensor, l2: float, normalise: bool, Wb: tuple):
        _, self.N, self.F = sites.shape
        self.sites, self.y, self.l2, self.normalise = sites, y, l2, normalise
        self.W, self.b = Wb
        self.dev = y.device  # the features' (fit_mix puts the labels and the start there)
        self.m, self.u, self.d = (torch.empty(self.F, self.N, device=self.dev) for _ in range(3))
        self.rows = torch.arange(self.N, device=self.dev)  # with y: each example's gold entry
        self.flat = False  # the end passed the convergence test by _flat_end, not by the gap

    def mix(self, p: torch.Tensor, out: torch.Tensor | None = None) -> tuple:
        """``(m [F, N], gamma)``: the mix of the sites with weights ``p`` (into ``out`` when
        given) and its scale."""
        m = self.sites.mix(p, out=out)
        var = m.var(1, unbiased=False).mean().clamp_min(1e-12)
        gamma = torch.rsqrt(var) if self.normalise else torch.ones((), device=self.dev)
        return m, gamma

    @torch.no_grad()
    def __call__(self, p: torch.Tensor) -> tuple:
        """``(g(p), dg/dp [S], largest probe-gradient entry)`` at weights ``p [S]`` (float32, on
        the features' device)."""
        m, gamma = self.mix(p, out=self.m)
        u = torch.mul(m, gamma, out=self.u)
        with torch.enable_grad():
            self.W, self.b = _probe_solve(u, self.y, self.W, self.b, self.l2)
        W, b = self.W, self.b
        Z = torch.addmm(b, u.T, W)  # [N, C]
        # the objective summed in float64: the mix's optimum is flat, and the line search compares
        # values that differ in their eighth digit (the [N, C] copy is small beside the features)
        f = torch.nn.functional.cross_entropy(Z.double(), self.y) + self.l2 * W.double().square().sum()
        G = torch.softmax(Z, 1)
        G[self.rows, self.y] -= 1.0
        G /= self.N
        gW, gb = torch.mm(u, G) + 2 * self.l2 * W, G.sum(0)
        D = torch.mm(W, G.T, out=self.d)  # df/du [F, N]
        if self.normalise:
            c = float(gamma) ** 3 / (self.F * self.N) * float(torch.dot(D.view(-1), m.view(-1)))
            D.mul_(gamma).sub_(m, alpha=c).add_(m.mean(1, keepdim=True), alpha=c)  # df/dm
        gp = self.sites.mix_grad(D)  # df/dp_s = <X_s, df/dm>
        return f, gp, max(float(gW.abs().max()), float(gb.abs().max()))


def simplex_gap(p, gp) -> float:
    """How far weights ``p [S]`` on the simplex are from stationary for a function with gradient
    ``gp = dg/dp``: the largest first-order decrease per unit weight moved from a used site to
    another, ``max_{s: p_s > 0} gp_s - min_t gp_t`` (the KKT conditions: every used site has the
    smallest gradient). Zero at a minimum; at a vertex it is the gain of moving toward the best
    other site, which the softmax-logit gradient ``p * (gp - p.gp)`` hides (it vanishes there)."""
    p, gp = np.asarray(p, dtype=np.float64), np.asarray(gp, dtype=np.float64)
    used = p > MIX_ZERO
    return float(gp[used].max() - gp.min()) if used.any() else float("inf")


def _converged(p, gp, gprobe: float, flat: bool = False) -> bool:
    """The mix's convergence test: simplex gap at most :data:`MIX_GAP` (or, ``flat``, no step
    along the gap's direction lowers the objective beyond its resolution: :func:`_flat_end`),
    probe gradient at most :data:`MIX_GTOL`."""
    return (simplex_gap(p, gp) <= MIX_GAP or flat) and gprobe <= MIX_GTOL


#: the steps :func:`_flat_end` tries, as fractions of the weight the gap's direction moves
FLAT_STEPS = (1.0, 0.1, 0.01, 0.001)


def _flat_end(g: _ProjectedMix, p: np.ndarray, gp: np.ndarray, f: float) -> bool:
    """Whether an end whose simplex gap is above :data:`MIX_GAP` is still a minimum to the
    objective's resolution: moving weight from the used site of the largest gradient to the site
    of the smallest (the direction the gap measures), by each fraction of :data:`FLAT_STEPS` of
    that weight, lowers the objective by at most :data:`MIX_FNOISE`. A descent that stopped early
    fails (a gap of 1e-3 and more buys more than that within these steps); a flat optimum whose
    float32 rounding leaves the gap a little above the mark (seen on a GPU: 1.1e-4) passes. The
    probe solves of the trials move ``g``'s warm start; the caller evaluates ``g`` at its end again."""
    used = np.flatnonzero(p > MIX_ZERO)
    i, j = used[np.argmax(gp[used])], int(np.argmin(gp))
    for frac in FLAT_STEPS:
        q = p.copy()
        q[i] -= frac * p[i]
        q[j] += frac * p[i]
        fq, _, _ = g(torch.as_tensor(q, dtype=torch.float32, device=g.dev))
        if f - float(fq) > MIX_FNOISE:
            return False
    return True


def _simplex_slsqp(g: _ProjectedMix, p0: np.ndarray, max_iters: int) -> tuple:
    """One descent of ``g`` over the simplex from ``p0``: scipy's SLSQP over the weights ``p``
    themselves (bounds ``0 <= p_s <= 1``, ``sum p = 1``), whose dense quasi-Newton model of the
    ``S x S`` Hessian suits the few, strongly correlated sites (neighbouring layers make the
    objective nearly flat along many directions). Working on ``p`` rather than softmax logits, a
    site the optimum does not use ends at exactly 0, and a vertex or face that is no minimum has a
    gradient that leaves it (the logits' gradient ``p * (gp - p.gp)`` vanishes there, which let
    an L-BFGS over logits stop on one). A descent that SLSQP ends short of the convergence test
    (a line search lost in float32 rounding) starts afresh from its end, up to
    :data:`MIX_RESTARTS` times. Returns ``(p [S], objective, dg/dp [S], probe gradient,
    iterations)`` at the end point (evaluated again there, so the probe in ``g`` is the end's)."""
    from scipy.optimize import minimize  # lazy: scipy comes with scikit-learn; only a mix fit needs it

    dev, S = g.dev, len(p0)

    def fun(q):
        q = np.maximum(q, 0.0)  # SLSQP may step a hair outside its bounds
        p = q / q.sum()
        f, gp, _ = g(torch.as_tensor(p, dtype=torch.float32, device=dev))
        return float(f), gp.double().cpu().numpy()

    one = {"type": "eq", "fun": lambda q: q.sum() - 1.0, "jac": lambda q: np.ones_like(q)}
    p, iters = np.asarray(p0, dtype=np.float64), 0
    for _ in range(MIX_RESTARTS):
        res = minimize(
            fun,
            p,
            jac=True,
            method="SLSQP",
            bounds=[(0.0, 1.0)] * S,
            constraints=[one],
            options={"maxiter": max(max_iters - iters, 1), "ftol": MIX_FTOL},
        )
        iters += int(res.nit)
        p = _on_simplex(res.x)
        f, gp, gprobe = g(torch.as_tensor(p, dtype=torch.float32, device=dev))
        gp = gp.double().cpu().numpy()
        if _converged(p, gp, gprobe) or iters >= max_iters:
            break
    g.flat = not _converged(p, gp, gprobe) and _flat_end(g, p, gp, float(f))
    if g.flat:  # the trials moved the probe's warm start: the end's own probe again
        f, gp, gprobe = g(torch.as_tensor(p, dtype=torch.float32, device=dev))
        gp = gp.double().cpu().numpy()
    return p, float(f), gp, gprobe, iters


def _on_simplex(q) -> np.ndarray:
    """``q`` clipped to ``[0, inf)``, weights below :data:`MIX_ZERO` set to 0, renormalised."""
    p = np.maximum(np.asarray(q, dtype=np.float64), 0.0)
    p /= p.sum()
    p[p < MIX_ZERO] = 0.0
    return p / p.sum()


def _starts(S: int, init_p: np.ndarray | None, n: int, seed: int) -> list:
    """The mix's starting weights: ``init_p`` (another fit's weights) or the uniform mix, then
    ``n - 1`` seeded random points of the simplex (Dirichlet(1)), the same on every machine."""
    first = np.full(S, 1.0 / S) if init_p is None else np.asarray(init_p, dtype=np.float64)
    rng = np.random.default_rng([seed, 31415])
    return [first] + [rng.dirichlet(np.ones(S)) for _ in range(max(n, 1) - 1)]


def fit_mix(
    X: torch.Tensor,
    y,
    *,
    n_classes: int,
    l2: float,
    normalise: bool = True,
    init: tuple | None = None,
    starts: int | None = None,
    seed: int = 0,
) -> MixFit:
    """Tenney's scalar mix over the sites of standardised features ``X [S, N, F]`` (a tensor,
    or :class:`~depthscope.probes.store.span_rows.SpanRows`, read as they are) with a linear
    probe, minimising ``mean CE(gamma * (sum_s p_s X_s) W + b) + l2 * ||W||^2`` over the weights
    ``p`` on the simplex and the probe ``W, b``: SLSQP over ``p`` with the probe solved at each
    (:class:`_ProjectedMix`, :func:`_simplex_slsqp`). ``normalise``: ``gamma = 1 /
    sqrt(mean_d var(mix_d))`` on ``X`` at every step (the module docstring says why); else
    ``gamma = 1``.

    The objective is flat over the simplex (equally informative sites differ in it by a few
    1e-4) and need not be convex in ``p``, so the fit descends from ``starts`` points (None:
    :data:`MIX_STARTS` from scratch, 1 from ``init``, another fit's ``state``): the first is
    ``init``'s weights or the uniform mix, the others seeded random mixes (``seed``). It keeps the
    lowest objective (an end within :data:`MIX_FNOISE` of it from an earlier start wins the tie);
    ``optima`` lists every start's end (weights, objective), and ``note`` says when two ends with
    objectives within :data:`MIX_FTIE` have weights more than :data:`MIX_WTOL` apart (two optima
    the data cannot tell apart). Converged: the kept end's :func:`simplex_gap` at most
    :data:`MIX_GAP` (or no step along the gap's direction lowers the objective beyond its
    resolution, :func:`_flat_end`) and its probe gradient at most :data:`MIX_GTOL`
    (``grad_max``: the larger of the gap and the probe gradient).
    The fit runs on ``X``'s device (a GPU's, for features held there: no copy to the CPU);
    ``weights`` come back as a NumPy array, ``state``
    stays on that device."""
    S, _, F_ = X.shape
    dev = X.device
    yt = torch.as_tensor(np.asarray(y), dtype=torch.long, device=dev)
    if init is None:
        init_p, W0, b0 = None, torch.zeros(F_, n_classes, device=dev), torch.zeros(n_classes, device=dev)
    else:
        a0, W0, b0 = (t.detach().float().to(dev) for t in init)
        init_p = torch.softmax(a0, 0).double().cpu().numpy()
    n = (MIX_STARTS if init is None else 1) if starts is None else int(starts)
    ends = []
    for p0 in _starts(S, init_p, n, seed):
        g = _ProjectedMix(_sites(X), yt, l2, normalise, (W0, b0))
        ends.append((*_simplex_slsqp(g, p0, MIX_MAX_ITERS), g))
    return _best_end(ends)


def _best_end(ends: list) -> MixFit:
    """The :class:`MixFit` of the lowest objective among the starts' ends ``(p, f, gp, gprobe,
    iterations, objective function)``; among ends within :data:`MIX_FNOISE` of it, the earliest
    start's (ties resolved the same way whatever the rounding: the uniform or warm start wins)."""
    low = min(e[1] for e in ends)
    p, f, gp, gprobe, _, g = next(e for e in ends if e[1] - low <= MIX_FNOISE)
    dev = g.dev
    with torch.no_grad():
        _, gamma = g.mix(torch.as_tensor(p, dtype=torch.float32, device=dev))
    a = torch.as_tensor(np.log(np.maximum(p, 1e-30)), dtype=torch.float32, device=dev)  # logits of p
    return MixFit(
        p,
        float(gamma),
        f,
        _converged(p, gp, gprobe, g.flat),
        sum(e[4] for e in ends),
        max(simplex_gap(p, gp), gprobe),
        (a, g.W, g.b),
        [(e[0], e[1]) for e in ends],
        _ties(ends),
    )


def _ties(ends: list) -> str:
    """A sentence when two starts ended within :data:`MIX_FTIE` of the lowest objective with
    weights more than :data:`MIX_WTOL` apart; else empty."""
    near = [e[0] for e in ends if e[1] - min(e[1] for e in ends) <= MIX_FTIE]
    far = max((float(np.abs(w - near[0]).max()) for w in near[1:]), default=0.0)
    if far <= MIX_WTOL:
        return ""
    return (
        f"two scalar-mix optima within {MIX_FTIE:g} of the objective have weights up to {far:.3f} apart: "
        "the data do not single out one mix, and E_s between them is not determined"
    )


def mix_draws(X: torch.Tensor, y, *, n_classes: int, l2: float, folds: int, seed: int, init: tuple) -> np.ndarray:
    """``[folds, S]``: the scalar mix (:func:`fit_mix`) refitted on train without each of
    ``folds`` seeded folds, warm-started from the full-train fit ``init``: the spread of the
    weights and of E_s that the training examples leave."""
    n = X.shape[1]
    fold = np.random.default_rng([seed, 2718]).permutation(n) % folds
    out = []
    for k in range(folds):
        keep = torch.from_numpy(np.flatnonzero(fold != k))
        Xk = X.take_rows(keep) if isinstance(X, SpanRows) else X.index_select(1, keep.to(X.device))
        out.append(fit_mix(Xk, np.asarray(y)[keep.numpy()], n_classes=n_classes, l2=l2, init=init).weights)
    return np.stack(out)


def scalar_mix(train: Features, y_train, *, n_classes: int, cfg: ProbeConfig, progress: bool = False, desc="mix"):
    """Tenney's scalar mix over all sites with the scale-neutral ``gamma`` (:func:`fit_mix`):
    ``((weights [S], TrainLog), draws [cfg.mix_folds, S] or None)``; the draws are refits without
    each of ``cfg.mix_folds`` folds (:func:`mix_draws`; fewer than 2: none). Resident features are needed; else
    (or for an MLP probe) the mix is trained jointly with its probe at ``gamma = 1`` by the probe
    solvers (the penalty's pull to one site included) and ``draws`` is None."""
    y = np.asarray(y_train)
    if train.resident is None or cfg.probe != "linear":
        return _penalised_mix(train, y, n_classes=n_classes, cfg=cfg, progress=progress, desc=desc), None
    X, yr = train.resident, y[train.order]  # the mix's fit runs where the features are held
    l2 = numeric_l2(cfg.l2)
    fit = fit_mix(X, yr, n_classes=n_classes, l2=l2, starts=cfg.mix_starts, seed=cfg.seed)
    draws = None
    if cfg.mix_folds >= 2:
        draws = mix_draws(X, yr, n_classes=n_classes, l2=l2, folds=cfg.mix_folds, seed=cfg.seed, init=fit.state)
    log = TrainLog(
        "lbfgs-b",
        fit.iterations,
        np.array([fit.converged]),
        np.array([fit.objective]),
        np.array([fit.grad_max]),
        not fit.converged,
        note=fit.note,
    )
    return (fit.weights, log), draws


def _penalised_mix(train: Features, y, *, n_classes: int, cfg: ProbeConfig, progress: bool, desc: str):
    """The scalar mix trained jointly with its probe by the probe solvers, ``gamma = 1``:
    ``(weights [S], TrainLog)``."""
    S = train.n_sites
    probe = site_probe(train, n_classes, cfg, mix_mask=torch.ones(1, S, dtype=torch.bool))
    log = train_probe(probe, train, torch.as_tensor(y)[:, None], progress=progress, desc=desc, **train_kwargs(cfg))
    with torch.no_grad():
        return probe.mix_weights()[0].double().numpy(), log


def fit_cumulative(
    train: Features,
    y_train,
    test: Features,
    y_test,
    *,
    n_classes: int,
    n_eval_classes: int,
    config: ProbeConfig | None = None,
    test_log_probs: torch.Tensor | None = None,
    init: dict | None = None,
    progress: bool = False,
    desc: str = "cumulative",
    **overrides,
) -> CumulativeFit:
    """Cumulative scoring ``P(0) .. P(S-1)`` (stacked per-site probes, see the module docstring)
    and the all-sites scalar mix; scored on ``test``. ``config`` (None: the defaults) sets the
    penalty and training of the per-site probes (linear); ``test_log_probs [S, N_test, C]``:
    the full-train per-site probes' log-probabilities on test when already computed (else
    fitted here), with ``init`` their state dict (one head) to warm-start the fold probes;
    ``overrides`` any config field by name. Stacked on ``cfg.stack_draws`` fold draws (each
    Newton solve from the previous draw's weights): accuracies, F1, weights their means."""
    (cfg,) = override([config or ProbeConfig()], overrides)
    yt = torch.as_tensor(np.asarray(y_test))
    if test_log_probs is None:
        p = site_probe(train, n_classes, cfg)
        train_probe(p, train, torch.as_tensor(np.asarray(y_train))[:, None], desc=desc, **train_kwargs(cfg))
        test_log_probs = log_probs(p, test)[:, :, 0]
        init = p.state_dict()

    def score(w, b):  # one draw's stacked prefixes on test
        return _score_stack(w, b, test_log_probs, yt, n_eval_classes)

    f1, ws, correct, soft, logs = _stacked_draws(train, y_train, n_classes, cfg, init, score, desc)
    (mix, mix_log), draws = scalar_mix(
        train, y_train, n_classes=n_classes, cfg=cfg, progress=progress, desc=f"{desc} mix"
    )
    correct = np.stack(correct)  # [R, S, N]
    return CumulativeFit(
        correct.mean((0, 2), dtype=np.float64),  # accuracy of P(s), mean over the draws
        np.mean(f1, 0, dtype=np.float64),
        np.mean(ws, 0),
        mix,
        correct,
        _merge_logs(logs),
        mix_log,
        np.stack(soft),
        draws,
    )


def _stacked_draws(train, y_train, n_classes: int, cfg, init, score: Callable, desc: str):
    """The cumulative probes of each of ``cfg.stack_draws`` fold draws: out-of-fold predictions,
    stacked (each Newton solve from the previous draw's weights) and scored on test by
    ``score(w, b) -> (soft accuracy, F1, correct)``. Returns the
    per-draw lists ``(f1, weights, correct, soft accuracy, logs)``."""
    R = cfg.stack_draws
    f1, ws, correct, soft, logs, prev = [], [], [], [], [], None
    for r in range(R):
        z_train = out_of_fold(
            train, y_train, n_classes=n_classes, cfg=cfg, init=init, draw=r, desc=f"{desc} draw {r + 1}/{R} "
        )
        release_memory()  # the fold copies the heap kept: the stacking allocates other sizes
        w, b, lg = stack(z_train, y_train, l2=cfg.stack_l2, init=prev)
        prev = (w, b)
        s_, f, c = score(w, b)
        soft.append(s_)
        f1.append(f)
        ws.append(w.detach().double().numpy())
        correct.append(c)
        logs.append(lg)
        del z_train
        release_memory()  # the draw's predictions, fold copies and stacking buffers
    return f1, ws, correct, soft, logs


@torch.no_grad()
def _score_stack(w, b, test_log_probs: torch.Tensor, yt: torch.Tensor, n_eval_classes: int) -> tuple:
    """One fold draw's stacked prefixes scored on test: the gold label's probability
    ``[S, N]``, the macro F1 ``[S]`` and whether the argmax is right ``[S, N]``."""
    logits = apply_stack(w, b, test_log_probs)  # [S, N, C]
    preds = logits.argmax(-1)
    soft = gold_probability(logits, yt).numpy()
    return soft, macro_f1(preds, yt, n_eval_classes).numpy(), (preds == yt[None]).numpy()


def _merge_logs(logs: list) -> TrainLog:
    """One TrainLog for the stacking of every fold draw: a prefix converged when it did in every
    draw; ``epochs``: the most iterations a draw took; objectives and gradients of the last draw."""
    last = logs[-1]
    conv = np.logical_and.reduce([lg.converged for lg in logs])
    history = [h for lg in logs for h in lg.history]
    return TrainLog(
        last.solver,
        max(lg.epochs for lg in logs),
        conv,
        last.objective,
        last.grad_max,
        any(lg.hit_cap for lg in logs),
        history,
    )
