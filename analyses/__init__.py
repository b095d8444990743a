"""depthscope.analyses: lens, norms, sweeps, plots, reports and the command line."""
