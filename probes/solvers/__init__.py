"""Solvers: the batched probe (one linear classifier per site and label set) and the numerics that fit
it to the optimum of its objective.

==================  ================================================================================
``classifiers``     :class:`BatchedProbe` (units x heads as one tensor model), ``site_probe``
``training``        the entry points: ``train_probe``, ``pick_solver`` (a table of solvers),
                    ``predict``, ``log_probs``
``base``            the one interface: ``TrainSettings``, ``Problem``, ``TrainLog``, ``Solver``
``methods``         the three solvers behind it: ``SubspaceSolver``, ``LbfgsSolver``, ``AdamSolver``
``objective``       the regularised objective (and gradient, curvature) every solver minimises
``subspace``        subspace Newton on tensors (per-site linear softmax probes)
``lbfgs``           batched L-BFGS and Newton on tensors, the shared stopping rule
``kfac``            the K-FAC preconditioner of the L-BFGS solver
``cpu``             the precision rule and thread count for the products
==================  ================================================================================

Imports run one way: ``training`` -> ``methods`` -> ``base``, ``objective``, ``kfac``, ``subspace``,
``lbfgs`` (``subspace`` and ``lbfgs`` work on tensors, not probes); nothing here imports the
science modules above (fitting, mixing, mdl, run).
"""
