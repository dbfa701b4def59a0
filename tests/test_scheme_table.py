"""The scheme table drives every scheme: its llm-compressor modifiers, the formats the engine decides on,
what the runner asks. Adding a scheme is a row of pipeline/schemes.py plus its tests."""

from __future__ import annotations

import pytest

from pipeline import schemes
from pipeline.engines.workers.quantize_worker import build_recipe
from pipeline.search import mixed

W4 = [s for s in schemes.SCHEMES.values() if s.takes_group_size]


@pytest.mark.parametrize("s", [s for s in schemes.SCHEMES.values() if s.producer == "llm-compressor"],
                         ids=lambda s: s.name)
def test_every_llm_compressor_row_builds_its_recipe(s):
    r = schemes.llmc_recipe(s.name, ["lm_head"], 64)
    mods = r["quant_stage"]["quant_modifiers"]
    assert mods and all(k.endswith("Modifier") for k in mods)
    last = list(mods.values())[-1]
    assert last["ignore"] == ["lm_head"]
    assert ("config_groups" in last) == s.takes_group_size and last.get("scheme") == s.llmc_preset
    assert build_recipe({"scheme": s.name, "ignore": ["lm_head"], "group_size": 64}) == r  # the worker asks the table


def test_the_algorithm_is_the_rows_not_a_name_branch():
    """AWQ smooths then rounds, GPTQ compensates, RTN rounds, W8A8 smooths then GPTQ: the same builders
    serve a uniform variant and the search's mixed candidates."""
    kinds = {s.name: list(schemes.llmc_recipe(s.name, [], 64)["quant_stage"]["quant_modifiers"]) for s in W4}
    assert kinds == {"awq_w4a16": ["AWQModifier", "QuantizationModifier"], "gptq_w4a16": ["GPTQModifier"],
                     "rtn_w4a16": ["QuantizationModifier"]}
    w8 = schemes.llmc_recipe("w8a8_int8", [], smoothing_strength=0.6)["quant_stage"]["quant_modifiers"]
    assert list(w8) == ["SmoothQuantModifier", "GPTQModifier"] and w8["SmoothQuantModifier"]["smoothing_strength"] == 0.6
    for s in W4:
        cand = mixed.candidate_recipe(s.name, 64, "w8a16", ["a"], ["b"], ["lm_head"])["quant_stage"]["quant_modifiers"]
        assert list(cand) == kinds[s.name]


def test_kv_scales_alone_and_schemes_without_a_recipe():
    kv = schemes.llmc_recipe("none", [], kv_cache="fp8_calibrated")["quant_stage"]["quant_modifiers"]
    assert kv == {"QuantizationModifier": {"kv_cache_scheme": schemes.KV_FP8}}
    for name, kv_cache in (("none", "auto"), ("bnb_nf4", "auto"), ("import", "auto"), ("nope", "auto")):
        with pytest.raises(ValueError, match="has no llm-compressor recipe"):
            schemes.llmc_recipe(name, [], kv_cache=kv_cache)
    with pytest.raises(SystemExit, match="quantize_worker: scheme 'bnb_int8'"):
        build_recipe({"scheme": "bnb_int8", "ignore": []})


def test_the_table_says_where_the_weights_come_from():
    assert [s.name for s in schemes.SCHEMES.values() if s.imports_checkpoint] == ["import"]
    assert [s.name for s in schemes.SCHEMES.values() if s.user_recipe] == ["custom"]
    assert all(s.weight_format is None for s in schemes.SCHEMES.values() if s.imports_checkpoint or s.user_recipe)
