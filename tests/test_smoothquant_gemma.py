"""SmoothQuant on Gemma 2/3 must be an exact rewrite before quantization; llm-compressor's default mappings are not.

Found when W8A8-INT8 of gemma3-270m came back with drift KL of 6 nats and no token agreeing with the
baseline (benchmarks/published_ordering.py): the defaults smooth gate/up against post_attention_layernorm,
which Gemma 3 applies to the attention's output. pipeline/schemes.py gives these models their own mappings.
"""

from __future__ import annotations

import json

import pytest

from pipeline import schemes
from pipeline.setup import envs, models

pytestmark = pytest.mark.integration


def test_sandwich_norm_models_get_their_own_mappings():
    def sq(model_type):
        return schemes.llmc_recipe("w8a8_int8", ["lm_head"], model_type=model_type)["quant_stage"]["quant_modifiers"][
            "SmoothQuantModifier"]

    assert "mappings" not in sq("llama") and "mappings" not in sq(None)  # llm-compressor's defaults are right there
    assert "re:.*pre_feedforward_layernorm" in json.dumps(sq("gemma3_text")["mappings"])


def test_smoothing_a_tiny_gemma3_leaves_its_logits_unchanged(tmp_path):
    out = tmp_path / "changed.json"
    envs.run_module("quantize", "tests.smoothquant_check", [str(out), str(models.builtin_model("smollm2-135m-instruct"))],
                    tmp_path / "smoothquant.log", timeout=600, what="SmoothQuant on a tiny Gemma 3")
    changed = json.loads(out.read_text())
    assert changed["ours"] < 1e-5, changed  # float32 rounding
    assert changed["default"] > 1e-2, changed  # the check can see a wrong mapping
