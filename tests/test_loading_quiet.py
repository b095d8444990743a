"""depthscope's own loads print no transformers progress bars ("Loading weights"), and leave the
caller's progress-bar setting as it was."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_tokenizer):
    from conftest import make_tiny

    d = tmp_path_factory.mktemp("tiny_quiet")
    make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=1, d_model=32).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize("bars_on", [True, False])
def test_loading_prints_no_progress_bars_and_restores_the_setting(tiny_folder, capfd, bars_on):
    from huggingface_hub import utils as hub_utils
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as tf_logging

    from depthscope.hooks import load_model

    before = (tf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled())
    try:
        (tf_logging.enable_progress_bar if bars_on else tf_logging.disable_progress_bar)()
        setting = (tf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled())
        capfd.readouterr()
        hm = load_model(tiny_folder)
        err = capfd.readouterr().err
        assert hm.n_layers == 1
        assert "Loading weights" not in err and "it/s" not in err
        assert (tf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled()) == setting
        if bars_on:  # the check can fail: a plain transformers load with bars on prints one
            AutoModelForCausalLM.from_pretrained(tiny_folder)
            assert "Loading weights" in capfd.readouterr().err
    finally:
        (tf_logging.enable_progress_bar if before[0] else tf_logging.disable_progress_bar)()
        (hub_utils.disable_progress_bars if before[1] else hub_utils.enable_progress_bars)()
