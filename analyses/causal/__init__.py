"""The causal room: whether the model uses what a site encodes, and where it computes a variable.

=================  ==================================================================
``erasure/``       is the property used: LEACE erasure per site against random
                   erasures, its effect on probes and on the next-token loss
                   (:func:`causal_tests`), every block skipped or swapped
                   (:func:`layer_interventions`), :class:`CausalConfig`,
                   :class:`LayersConfig`, their figures
``variables/``     where a variable is computed: counterfactual examples, interchange
                   interventions (:func:`interchange`), DAS (:func:`das`), learned
                   subspaces, :class:`LocalizeConfig`, their figures
=================  ==================================================================

Every name either exports is exported here too.
"""

from __future__ import annotations

from depthscope.analyses.causal import erasure, variables
from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    **{name: f"erasure.{mod}" for name, mod in erasure._EXPORTS.items()},
    **{name: f"variables.{mod}" for name, mod in variables._EXPORTS.items()},
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
