"""The lens room: what each residual site predicts when read as the model's output.

=================  ==================================================================
``logit.py``       :func:`logit_lens` (per-site metrics over a text, intervals by
                   document), :func:`logit_lens_tokens` (per token of a prompt)
``lenses.py``      :class:`LogitLens`, :class:`TunedLens`: small interchangeable lenses
``tuned.py``       :func:`train_tuned_lens` (Belrose et al. 2023)
``interop.py``     :func:`import_tuned_lens`, :func:`export_tuned_lens`: the ``tuned-lens``
                   package's folders (translators at block inputs = sites 0, 2, .., 2L-2)
``config.py``      :class:`TunedLensTraining`, :class:`LensConfig`, :class:`LensTrainConfig`
``plots.py``       the lens figures, drawn from the tables
=================  ==================================================================
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "logit_lens": "logit",
    "logit_lens_tokens": "logit",
    "Streaming": "logit",
    "Lens": "lenses",
    "LogitLens": "lenses",
    "TunedLens": "lenses",
    "LensMismatchError": "lenses",
    "train_tuned_lens": "tuned",
    "import_tuned_lens": "interop",
    "export_tuned_lens": "interop",
    "block_input_sites": "interop",
    "TunedLensTraining": "config",
    "LensConfig": "config",
    "LensTrainConfig": "config",
    "plot_lens_metrics": "plots",
    "plot_top1_heatmap": "plots",
    "plot_rank_trajectory": "plots",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
