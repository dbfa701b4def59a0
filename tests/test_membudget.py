"""The memory budget (pipeline/measure/membudget.py): weights as loaded from the headers, the pool each
engine gets, projected plans, and budgets too small to start an engine (exit 2 naming the field)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from pipeline.measure import capacity, membudget, metrics
from pipeline.recipe.schema import EngineSpec, RecipeError, load
from pipeline.results import KVCapacity, SystemsResult

ROOT = Path(__file__).resolve().parent.parent
CFG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "num_attention_heads": 4,
       "num_key_value_heads": 2, "hidden_size": 256, "max_position_embeddings": 1024}
RESERVE = {"reserve_bytes": 300 * 2**20, "source": "fixture"}


def checkpoint(d: Path, quantized: bool) -> Path:
    """A bf16 embedding and norm, and either bf16 Linear weights or int8 ones with bf16 scales."""
    d.mkdir(parents=True, exist_ok=True)
    t = {"model.embed_tokens.weight": torch.zeros(1000, 256, dtype=torch.bfloat16),
         "model.norm.weight": torch.zeros(256, dtype=torch.bfloat16),
         "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(32)}  # not a parameter the engine holds
    for i in range(4):
        if quantized:
            t[f"model.layers.{i}.mlp.down_proj.weight"] = torch.zeros(256, 1024, dtype=torch.int8)
            t[f"model.layers.{i}.mlp.down_proj.weight_scale"] = torch.zeros(256, 1, dtype=torch.bfloat16)
        else:
            t[f"model.layers.{i}.mlp.down_proj.weight"] = torch.zeros(256, 1024, dtype=torch.bfloat16)
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(CFG))
    return d


def test_weights_as_loaded_in_the_engine_dtype_quantized_as_stored(tmp_path):
    dense, q8 = checkpoint(tmp_path / "dense", False), checkpoint(tmp_path / "q8", True)
    floats = 1000 * 256 + 256
    assert membudget.weights_as_loaded(dense, 4) == (floats + 4 * 256 * 1024) * 4  # bf16 file, float32 engine
    assert membudget.weights_as_loaded(dense, 2) == (floats + 4 * 256 * 1024) * 2
    assert membudget.weights_as_loaded(q8, 4) == (floats + 4 * 256) * 4 + 4 * 256 * 1024  # int8 as stored
    assert membudget.weights_as_loaded(dense, 4, tp=2) == membudget.weights_as_loaded(dense, 4) // 2
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0notjson!")
    with pytest.raises(ValueError, match="bad/model.safetensors: not a safetensors file"):
        membudget.weights_as_loaded(tmp_path / "bad", 4)


def test_the_budget_turns_smaller_weights_into_kv_tokens(tmp_path):
    dense, q8 = checkpoint(tmp_path / "dense", False), checkpoint(tmp_path / "q8", True)
    e = EngineSpec(memory_budget_gib=1.0, max_model_len=512)
    plans = {n: membudget.plan(e, CFG, d, 4, 4, False, RESERVE, seq_len=320) for n, d in (("b", dense), ("v", q8))}
    b, v = plans["b"], plans["v"]
    for p in (b, v):  # pool = budget - weights as loaded - the one reserve
        assert p.mode == "budget" and p.pool_bytes == 2**30 - p.weights_bytes - RESERVE["reserve_bytes"]
    lay = capacity.layout(CFG, 4, block=128)
    assert v.tokens - b.tokens == pytest.approx((b.weights_bytes - v.weights_bytes) / lay.bytes_per_block * 128,
                                                abs=128)  # within one block of the arithmetic
    assert v.admitted > b.admitted
    # fixed mode: the same pool whatever the weights ("same pool" experiments)
    f = EngineSpec(kv_cache_gib=0.25)
    assert {membudget.plan(f, CFG, d, 4, 4, False).pool_bytes for d in (dense, q8)} == {2**28}
    # FP8 KV on top of the smaller weights: a quarter of the bytes per token
    v8 = membudget.plan(e, CFG, q8, 4, 1, False, RESERVE)
    assert v8.tokens // 128 == v.pool_bytes // (lay.bytes_per_block // 4)
    # on a GPU vLLM sizes the pool itself: no size is passed
    g = membudget.plan(e, CFG, dense, 2, 2, True)
    assert g.mode == "gpu" and g.pool_bytes is None


def test_projected_plans_never_pass_as_measured(tmp_path):
    dense, q8 = checkpoint(tmp_path / "dense", False), checkpoint(tmp_path / "q8", True)
    e = EngineSpec(memory_budget_gib=1.0, max_model_len=512)
    p = membudget.plan(e, CFG, dense, 4, 4, False, RESERVE, projected_from=q8, seq_len=320)
    assert p.projected and p.weights_bytes == membudget.weights_as_loaded(q8, 4)
    base_plan = membudget.plan(e, CFG, dense, 4, 4, False, RESERVE)
    kv = membudget.projected_capacity(p)
    assert kv.tokens is None and kv.num_blocks is None and kv.tokens_config == p.tokens
    base = SystemsResult(variant="baseline", input_hash="s", status="ok", duration_s=1.0,
                         kv=KVCapacity(block_size=128, num_blocks=base_plan.tokens // 128, tokens=base_plan.tokens,
                                       max_concurrency=None, bytes_per_token_config=None, plan=base_plan))
    var = SystemsResult(variant="v", input_hash="s", status="skipped", duration_s=0.0, kv=kv)
    m = metrics.kv_tokens_ratio(metrics.Inputs(systems=var, base_systems=base), "overall")
    assert m.value is None and m.caveat.startswith("projected KV tokens ratio ")
    assert float(m.caveat.split()[4]) == pytest.approx(p.tokens / base_plan.tokens, abs=0.01)


def test_a_budget_that_cannot_hold_one_sequence_is_rejected_with_the_bytes_needed(tmp_path):
    dense = checkpoint(tmp_path / "dense", False)
    e = EngineSpec(memory_budget_gib=0.25, max_model_len=512)
    p = membudget.plan(e, CFG, dense, 4, 4, False, RESERVE)
    with pytest.raises(ValueError, match=r"engine.memory_budget_gib: 0.25 GiB cannot hold the base model: .* need "
                                         r"0\.\d\d GiB \(\d+ bytes\)"):
        membudget.check_fits(p, CFG, e, 4, "the base model")
    need = int(str(pytest.raises(ValueError, membudget.check_fits, p, CFG, e, 4, "x").value).split("(")[-1].split()[0])
    assert need == p.weights_bytes + RESERVE["reserve_bytes"] + capacity.layout(CFG, 4, block=128).pool_for(512)
    ok = membudget.plan(EngineSpec(memory_budget_gib=need / 2**30 + 0.001, max_model_len=512), CFG, dense, 4, 4,
                        False, RESERVE)
    membudget.check_fits(ok, CFG, e, 4, "the base model")


def test_validate_rejects_a_budget_below_the_weights_before_any_engine(tmp_path):
    dense = checkpoint(tmp_path / "model", False)
    (dense / "tokenizer.json").write_text("{}")
    d = yaml.safe_load((ROOT / "recipes" / "awq.yaml").read_text())
    d["model"] = {"path": str(dense)}
    d["engine"].update(max_model_len=512, memory_budget_gib=0.001)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(d))
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "QUANTIZE_EVAL_HOME": str(tmp_path / "home")}
    for cmd in (["validate", str(path)], [str(path)]):
        proc = subprocess.run([sys.executable, "-m", "pipeline.cli", *cmd], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "engine.memory_budget_gib: 0.001 GiB cannot hold the base model" in proc.stderr
        assert proc.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()


def test_one_pool_rule_in_the_recipe(tmp_path):
    assert EngineSpec().budget_gib == 4.0 and EngineSpec(kv_cache_gib=1).budget_gib is None
    d = yaml.safe_load((ROOT / "recipes" / "awq.yaml").read_text())
    d["engine"]["kv_cache_gib"] = 1.0
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(RecipeError, match="set one of engine.memory_budget_gib .* or engine.kv_cache_gib"):
        load(p)
    d["engine"].pop("kv_cache_gib")
    d["gates"].append({"metric": "admission_ratio", "op": ">=", "threshold": 1.2})
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(RecipeError, match="admission_ratio needs workload.admission_probe: true"):
        load(p)


def test_validate_states_what_the_budget_leaves_once_the_reserve_is_known(tmp_path, monkeypatch):
    from pipeline.run import preflight
    from pipeline.runstore import hash_obj, write_json
    from pipeline.stages import reserve
    from pipeline.store import provenance

    monkeypatch.setenv("QUANTIZE_EVAL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("QUANTIZE_EVAL_DEVICE", "cpu")
    model = checkpoint(tmp_path / "model", False)
    (model / "tokenizer.json").write_text("{}")
    d = yaml.safe_load((ROOT / "recipes" / "awq.yaml").read_text())
    d["model"] = {"path": str(model)}
    d["engine"].update(max_model_len=512, memory_budget_gib=1.0, dtype="float32")
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(d))
    r = load(p)
    assert "the runtime reserve is measured on the first run" in preflight.budget_statement(r, model)
    key = reserve.reserve_key(r, hash_obj(provenance.model_hashes(model)), "float32")
    write_json(tmp_path / "home" / "results" / "reserve" / f"{key}.json",
               {"key": key, **RESERVE, "measured_at": "2026-12-01 00:00:00"})
    line = preflight.budget_statement(r, model)
    plan = membudget.plan(r.engine, CFG, model, 4, 4, False, RESERVE, seq_len=320)
    assert f"leave a {plan.pool_bytes / 2**30:.2f} GiB KV pool: {plan.tokens:,} tokens, {plan.admitted} requests" in line
