"""Sums over sites in float32 (probes/store/site_sums.py), whatever the features' precision:
equal to float64 sums of the same values across chunk boundaries, and a scalar mix over bfloat16
features that reaches the fit of the same values held in float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from depthscope.probes.mixing import fit_mix
from depthscope.probes.store import site_sums
from depthscope.probes.store.site_sums import site_inner, weighted_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_site_sums_equal_float64_sums_of_the_same_values(monkeypatch, dtype):
    """Chunks of 7 columns over 40 (the last chunk short): each sum is the float64 one of
    the values as held, to float32 rounding. A product in bfloat16 would round the weights and
    each sum to 8 significant bits (relative errors near 1e-2)."""
    monkeypatch.setattr(site_sums, "CHUNK", 7)
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(5, 40, generator=g).to(dtype)
    p = torch.softmax(torch.randn(5, generator=g), 0) + 1e-3 * torch.rand(5, generator=g)
    d = torch.randn(40, generator=g)
    ref = flat.double()
    np.testing.assert_allclose(weighted_sum(flat, p).numpy(), (p.double() @ ref).numpy(), rtol=1e-6, atol=1e-6)
    out = torch.full((40,), float("nan"))
    assert weighted_sum(flat, p, out) is out and not out.isnan().any()
    got = site_inner(flat, d)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), (ref @ d.double()).numpy(), rtol=1e-6, atol=1e-5)


def test_a_bfloat16_scalar_mix_is_the_float32_mix_of_the_same_values():
    """The mix over features held in bfloat16 and over the same values in float32: the same
    optimum (weights, objective), both converged."""
    g = torch.Generator().manual_seed(2)
    S, N, F, C = 6, 600, 8, 3
    y = torch.randint(C, (N,), generator=g)
    signal = torch.randn(C, F, generator=g)
    scale = torch.linspace(0.2, 1.0, S)[:, None, None]  # later sites more informative
    X = scale * signal[y] + torch.randn(S, N, F, generator=g)
    X = ((X - X.mean(1, keepdim=True)) / X.std(1, keepdim=True)).to(torch.bfloat16)
    narrow = fit_mix(X, y.numpy(), n_classes=C, l2=1e-2)
    wide = fit_mix(X.float(), y.numpy(), n_classes=C, l2=1e-2)
    assert narrow.converged and wide.converged
    np.testing.assert_allclose(narrow.weights, wide.weights, atol=2e-3)
    assert narrow.objective == pytest.approx(wide.objective, rel=1e-6)
