"""depthscope.common: the plumbing every layer shares (errors, atomic files, progress, content stamps,
weight digests, runtime settings). It imports nothing else of depthscope, so hooks/, probes/ and
analyses/ may all import it."""
