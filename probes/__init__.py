"""depthscope.probes: labelled data and classifiers (Tenney-style probing)."""
