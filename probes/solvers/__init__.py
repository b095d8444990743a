"""Solvers: the batched probe (one linear classifier per site and label set) and the numerics that fit
it to the optimum of its objective."""
