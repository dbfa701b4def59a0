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
OVERHEAD = {"outside_bytes": 200 * 2**20, "runtime_bytes": 100 * 2**20, "source": "fixture"}
KEPT = OVERHEAD["outside_bytes"] + OVERHEAD["runtime_bytes"]


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
    plans = {n: membudget.plan(e, CFG, d, 4, 4, False, OVERHEAD, seq_len=320) for n, d in (("b", dense), ("v", q8))}
    b, v = plans["b"], plans["v"]
    for p in (b, v):  # predicted pool = budget - outside - weights as loaded - runtime
        assert p.mode == "budget" and p.pool_bytes == p.predicted_pool_bytes == 2**30 - p.weights_bytes - KEPT
    lay = capacity.layout(CFG, 4, block=128)
    assert v.tokens - b.tokens == pytest.approx((b.weights_bytes - v.weights_bytes) / lay.bytes_per_block * 128,
                                                abs=128)  # within one block of the arithmetic
    assert v.admitted > b.admitted
    # fixed mode: the same pool whatever the weights ("same pool" experiments)
    f = EngineSpec(kv_cache_gib=0.25)
    assert {membudget.plan(f, CFG, d, 4, 4, False).pool_bytes for d in (dense, q8)} == {2**28}
    # FP8 KV on top of the smaller weights: a quarter of the bytes per token
    v8 = membudget.plan(e, CFG, q8, 4, 1, False, OVERHEAD)
    assert v8.tokens // 128 == v.pool_bytes // (lay.bytes_per_block // 4)
    # on a GPU vLLM sizes the pool itself: no size is passed
    g = membudget.plan(e, CFG, dense, 2, 2, True)
    assert g.mode == "gpu" and g.pool_bytes is None


def test_projected_plans_never_pass_as_measured(tmp_path):
    dense, q8 = checkpoint(tmp_path / "dense", False), checkpoint(tmp_path / "q8", True)
    e = EngineSpec(memory_budget_gib=1.0, max_model_len=512)
    p = membudget.plan(e, CFG, dense, 4, 4, False, OVERHEAD, projected_from=q8, seq_len=320)
    assert p.projected and p.weights_bytes == membudget.weights_as_loaded(q8, 4)
    base_plan = membudget.plan(e, CFG, dense, 4, 4, False, OVERHEAD)
    kv = membudget.projected_capacity(p)
    assert kv.tokens is None and kv.num_blocks is None and kv.tokens_config == p.tokens
    base = SystemsResult(variant="baseline", input_hash="s", status="ok", duration_s=1.0,
                         kv=KVCapacity(block_size=128, num_blocks=base_plan.tokens // 64, tokens=base_plan.tokens * 2,
                                       max_concurrency=None, bytes_per_token_config=None, plan=base_plan))
    var = SystemsResult(variant="v", input_hash="s", status="skipped", duration_s=0.0, kv=kv)
    m = metrics.kv_tokens_ratio(metrics.Inputs(systems=var, base_systems=base), "overall")
    assert m.value is None and m.caveat.startswith("projected KV tokens ratio ")
    # against the baseline's own prediction (the same arithmetic), not its engine's figure (here twice that)
    assert float(m.caveat.split()[4]) == pytest.approx(p.tokens / base_plan.predicted_tokens, abs=0.01)


def test_a_budget_that_cannot_hold_one_sequence_is_rejected_with_the_bytes_needed(tmp_path):
    dense = checkpoint(tmp_path / "dense", False)
    e = EngineSpec(memory_budget_gib=0.25, max_model_len=512)
    p = membudget.plan(e, CFG, dense, 4, 4, False, OVERHEAD)
    with pytest.raises(ValueError, match=r"engine.memory_budget_gib: 0.25 GiB cannot hold the base model: .* need "
                                         r"0\.\d\d GiB \(\d+ bytes\)"):
        membudget.check_fits(p, CFG, e, 4, "the base model")
    need = int(str(pytest.raises(ValueError, membudget.check_fits, p, CFG, e, 4, "x").value).split("(")[-1].split()[0])
    assert need == p.weights_bytes + KEPT + capacity.layout(CFG, 4, block=128).pool_for(512)
    ok = membudget.plan(EngineSpec(memory_budget_gib=need / 2**30 + 0.001, max_model_len=512), CFG, dense, 4, 4,
                        False, OVERHEAD)
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


def _budget_recipe(tmp_path, monkeypatch, budget_gib: float):
    """The default recipe on a tiny dense checkpoint with this budget, in a home of its own: (recipe, path, model)."""
    monkeypatch.setenv("QUANTIZE_EVAL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("QUANTIZE_EVAL_DEVICE", "cpu")
    model = checkpoint(tmp_path / "model", False)
    (model / "tokenizer.json").write_text("{}")
    d = yaml.safe_load((ROOT / "recipes" / "awq.yaml").read_text())
    d["model"] = {"path": str(model)}
    d["engine"].update(max_model_len=512, memory_budget_gib=budget_gib, dtype="float32")
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(d))
    r = load(p)
    return r, p, model


def test_validate_states_what_the_budget_leaves_from_this_hosts_figures(tmp_path, monkeypatch):
    from pipeline.measure import overhead
    from pipeline.run import preflight

    r, p, model = _budget_recipe(tmp_path, monkeypatch, 2.0)
    prior = preflight.budget_statement(r, model)
    m = overhead.model_label(r)  # the figures are this host's for this base model
    assert "not measured on this host yet" in prior
    # a first engine that held less than the prior leaves the outside figure (and so every key) be; its
    # runtime, off by more than the tolerance, becomes the host's
    overhead.record("float32", {"outside_bytes": 2**29, "runtime_bytes": 2**28}, 2**26, "m", m)
    assert overhead.host_figures("float32", m)["outside_bytes"] == overhead.PRIOR["outside_bytes"]
    line = preflight.budget_statement(r, model)
    plan = membudget.plan(r.engine, CFG, model, 4, 4, False, {**OVERHEAD, "outside_bytes": overhead.PRIOR["outside_bytes"],
                                                              "runtime_bytes": 2**28}, seq_len=320)
    assert f"leave a predicted {plan.pool_bytes / 2**30:.2f} GiB KV pool: {plan.tokens:,} tokens" in line
    assert "outside: the prior" in line and "runtime: measured on this host by an engine of m " in line
    heavy = overhead.PRIOR["outside_bytes"]
    overhead.record("float32", {"outside_bytes": heavy + 2**25, "runtime_bytes": 2**28}, 2**26, "other", m)
    assert "outside: the prior" in preflight.budget_statement(r, model)  # within the tolerance: kept
    overhead.record("float32", {"outside_bytes": heavy + 2**27, "runtime_bytes": 2**28}, 2**26, "heavier", m)
    assert "outside: measured on this host by an engine of heavier " in preflight.budget_statement(r, model)
    overhead.record("float32", {"outside_bytes": 2**28, "runtime_bytes": 2**28}, 2**26, "lighter", m)
    assert "an engine of heavier " in preflight.budget_statement(r, model)  # outside never falls: peaks seen stay kept
    overhead.record("float32", {"outside_bytes": 2**28, "runtime_bytes": 2**29}, 2**26, "runtime moved", m)
    assert overhead.host_figures("float32", m)["outside_bytes"] == heavy + 2**27  # kept while runtime follows
    assert overhead.host_figures("float32", m)["runtime_bytes"] == 2**29


def test_a_run_sizes_every_engine_with_the_figures_it_started_with(tmp_path, monkeypatch):
    from pipeline.measure import overhead

    monkeypatch.setenv("QUANTIZE_EVAL_HOME", str(tmp_path / "home"))
    first = overhead.for_run(tmp_path / "run", "float32", log=lambda m: None)
    assert first["outside_bytes"] == overhead.PRIOR["outside_bytes"]
    overhead.record("float32", {"outside_bytes": 3 * 2**30, "runtime_bytes": 2**30}, 2**26, "m")
    assert overhead.for_run(tmp_path / "run", "float32", log=lambda m: None) == first  # fixed for the run
    assert overhead.for_run(tmp_path / "run2", "float32", log=lambda m: None)["outside_bytes"] == 3 * 2**30


def test_an_engine_over_its_budget_earns_no_capacity(tmp_path):
    """Over the budget by more than the tolerance: every capacity gate ERRORs, the trade-off line and the
    requests that fit say it was not earned; within the tolerance nothing changes."""
    from pipeline.stages import signoff

    dense, q8 = checkpoint(tmp_path / "dense", False), checkpoint(tmp_path / "q8", True)
    e = EngineSpec(memory_budget_gib=1.0, max_model_len=512)
    plans = {n: membudget.plan(e, CFG, d, 4, 4, False, OVERHEAD, seq_len=320) for n, d in (("b", dense), ("v", q8))}
    tol = membudget.tolerance(2**30)
    assert tol == 64 * 2**20 and membudget.tolerance(10 * 2**30) == 10 * 2**30 // 50

    def systems(name, plan, peak):
        from pipeline.results import Latency, Percentiles

        plan = plan.model_copy(update={"peak_bytes": peak})
        p = Percentiles(p50=1.0, p95=1.0, p99=1.0)
        lat = Latency(ttft_ms=p, tpot_ms=p, itl_ms=p, e2e_ms=p, completed=1, failed=0, timed_out=0, output_tokens=1,
                      duration_s=1.0, output_tok_per_s=1.0, request_per_s=1.0)
        return SystemsResult(variant=name, input_hash="s", status="ok", duration_s=1.0, latency=lat, kv=KVCapacity(
            block_size=128, num_blocks=plan.tokens // 128, tokens=plan.tokens, max_concurrency=None,
            bytes_per_token_config=None, admission_sequences=4, admission_kv_only=9, plan=plan))

    base = systems("baseline", plans["b"], 2**30)
    from pipeline.recipe.schema import GateSpec

    for peak, want in ((2**30 + tol, "PASS"), (2**30 + tol + 2**20, "ERROR")):
        var = systems("v", plans["v"], peak)
        inp = metrics.Inputs(systems=var, base_systems=base)
        assert (var.kv.plan.over_budget_bytes is None) == (want == "PASS")
        for metric, threshold in (("kv_tokens_ratio", 1.0), ("max_concurrency", 2)):
            out = signoff._one_gate(GateSpec(metric=metric, op=">=", threshold=threshold), "overall", inp)
            assert out.outcome == want, out
            assert ("the variant's engine peaked" in out.note and "over its 1.00 GiB budget" in out.note) \
                == (want == "ERROR")
        if want == "PASS":
            assert metrics.max_concurrency(inp, "overall").value == 4  # the KV bound (9) capped by max_num_seqs
    # the baseline over its budget spoils every ratio against it
    with pytest.raises(metrics.OverBudget, match="the baseline's engine peaked"):
        metrics.kv_tokens_ratio(metrics.Inputs(systems=systems("v", plans["v"], 2**30),
                                               base_systems=systems("baseline", plans["b"], 2 * 2**30)), "overall")


def test_without_a_budget_the_default_grows_to_hold_the_base_model(tmp_path):
    """No engine.memory_budget_gib: the default, unless the base model with a full batch of max_model_len
    sequences needs more, then that (a larger model must not fail on a default); the source says which."""
    dense = checkpoint(tmp_path / "dense", False)
    given = EngineSpec(memory_budget_gib=1.5, max_model_len=512)
    assert membudget.run_budget(given, CFG, dense, 4, 4, OVERHEAD) == (int(1.5 * 2**30), "engine.memory_budget_gib")
    small = EngineSpec(max_model_len=512, max_num_seqs=4)
    b, why = membudget.run_budget(small, CFG, dense, 4, 4, OVERHEAD)
    assert b == 4 * 2**30 and why.startswith("the default 4 GiB")
    big = {**OVERHEAD, "runtime_bytes": 5 * 2**30}  # a runtime no 4 GiB budget holds
    b, why = membudget.run_budget(small, CFG, dense, 4, 4, big)
    need = KEPT - OVERHEAD["runtime_bytes"] + 5 * 2**30 + membudget.weights_as_loaded(dense, 4) + \
        capacity.layout(CFG, 4, block=128).pool_for(512, 4)
    assert why.startswith("derived") and need <= b < need + 2**28 and b % 2**28 == 0
    p = membudget.plan(small, CFG, dense, 4, 4, False, {**big, "budget_bytes": b, "budget_source": why})
    assert p.budget_bytes == b and p.budget_source == why
    membudget.check_fits(p, CFG, small, 4, "the base model")  # the derived budget holds what it was derived for


def test_capacity_across_budgets_is_the_engine_at_its_budget_and_its_own_overhead_elsewhere(tmp_path):
    dense, q8 = checkpoint(tmp_path / "dense", False), checkpoint(tmp_path / "q8", True)
    e = EngineSpec(memory_budget_gib=2.0, max_model_len=512)
    lay = capacity.layout(CFG, 4, block=128)
    curves = {}
    for name, d, non_kv in (("b", dense, 900 * 2**20), ("v", q8, 880 * 2**20)):
        p = membudget.plan(e, CFG, d, 4, 4, False, OVERHEAD, seq_len=320)
        engine_pool = 2 * 2**30 - OVERHEAD["outside_bytes"] - non_kv - 3 * 2**20  # what an engine chose
        membudget.verify(p, CFG, 4, 1, 128, lay.tokens(engine_pool), p.weights_bytes, 2**31, 320,
                         {"non_kv_bytes": non_kv, "requested_bytes": 2 * 2**30 - OVERHEAD["outside_bytes"]})
        pts = membudget.across_budgets(p, CFG, 4, 1, 320, 512)
        assert len(pts) >= 4 and [pt["measured"] for pt in pts].count(True) == 1
        first = pts[0]  # the smallest budget that serves one max_model_len sequence
        assert first["budget_bytes"] >= OVERHEAD["outside_bytes"] + non_kv + lay.pool_for(512)
        assert first["budget_bytes"] - 2**26 < OVERHEAD["outside_bytes"] + non_kv + lay.pool_for(512)
        for pt in pts:
            if pt["measured"]:
                assert pt["budget_bytes"] == 2 * 2**30 and pt["pool_bytes"] == p.pool_bytes
            else:
                assert pt["pool_bytes"] == pt["budget_bytes"] - OVERHEAD["outside_bytes"] - non_kv
            assert pt["requests"] == lay.admitted(pt["pool_bytes"], 320)
        assert [pt["requests"] for pt in pts] == sorted(pt["requests"] for pt in pts)
        curves[name] = {pt["budget_bytes"]: pt["tokens"] for pt in pts if not pt["measured"]}
    # what the variant frees is the same at every budget both serve (in whole blocks)
    both = set(curves["b"]) & set(curves["v"])
    assert len({curves["v"][b] - curves["b"][b] for b in both}) <= 2
    fixed = membudget.plan(EngineSpec(kv_cache_gib=0.5), CFG, dense, 4, 4, False)
    assert membudget.across_budgets(fixed, CFG, 4, 1, 320, 512) == []


def test_under_tensor_parallelism_the_budget_holds_the_whole_tree(tmp_path):
    """The budget is the whole engine tree's: what runs outside the workers once, then each rank its
    weights shard, runtime and pool. Ranks' parts summed never exceed the budget, the engine's fraction
    asks each worker for its share, and budgets across the sweep keep the same per-rank accounting
    (this mixed per-rank weights with the whole tree's budget: each rank was handed almost the lot)."""
    from pipeline.engines.vllm import sizing

    dense = checkpoint(tmp_path / "dense", False)
    for tp in (1, 2, 4):
        e = EngineSpec(memory_budget_gib=2.0, max_model_len=512, tensor_parallel_size=tp)
        p = membudget.plan(e, CFG, dense, 4, 4, False, OVERHEAD, seq_len=320)
        assert p.weights_bytes == membudget.weights_as_loaded(dense, 4) // tp
        whole = p.outside_bytes + tp * (p.weights_bytes + p.runtime_bytes + p.pool_bytes)
        assert 2 * 2**30 - tp <= whole <= 2 * 2**30, (tp, whole)
        # per rank, tokens are what the rank's pool holds of its share of the KV heads
        assert p.tokens == capacity.layout(CFG, 4, block=128, tp=tp).tokens(p.pool_bytes)
        non_kv = p.weights_bytes + p.runtime_bytes
        membudget.verify(p, CFG, 4, tp, 128, p.tokens, p.weights_bytes, 2**31, 320, {"non_kv_bytes": non_kv})
        for pt in membudget.across_budgets(p, CFG, 4, tp, 320, 512):
            assert p.outside_bytes + tp * (non_kv + pt["pool_bytes"]) <= pt["budget_bytes"]
    total = sizing.node_memory()[0]
    one, two = (sizing.fraction(2**30, 2**28, tp)["fraction"] for tp in (1, 2))
    assert two * total == pytest.approx(one * total / 2, abs=2 * total / 1e6)  # each of 2 workers asks half
    # a budget too small for a tensor-parallel tree says what the whole tree needs
    small = EngineSpec(memory_budget_gib=0.5, max_model_len=512, tensor_parallel_size=2)
    p = membudget.plan(small, CFG, dense, 4, 4, False, {**OVERHEAD, "runtime_bytes": 2**28})
    with pytest.raises(ValueError, match="need") as exc:
        membudget.check_fits(p, CFG, small, 4, "the base model")
    need = int(str(exc.value).rsplit("(", 1)[1].split()[0])
    assert need == OVERHEAD["outside_bytes"] + 2 * (p.weights_bytes + 2**28 + capacity.layout(
        CFG, 4, block=128, tp=2).pool_for(512))


def test_the_console_prints_the_peak_the_budget_is_judged_on():
    """The stage's line must show the kernel's high-water mark (what the budget check reads), not the
    sampled RSS sum, which counts a forked process's shared pages twice and read 0.2 GiB over it."""
    from pipeline.results import Latency, Percentiles
    from pipeline.stages.systems import summary

    pct = Percentiles(p50=1.0, p95=1.0, p99=1.0)
    lat = Latency(ttft_ms=pct, tpot_ms=pct, itl_ms=pct, e2e_ms=pct, completed=1, failed=0, timed_out=0,
                  output_tokens=1, duration_s=1.0, output_tok_per_s=1.0, request_per_s=1.0)
    kv = KVCapacity(block_size=128, num_blocks=1, tokens=128, max_concurrency=None, bytes_per_token_config=None)
    s = SystemsResult(variant="v", input_hash="s", status="ok", duration_s=1.0, latency=lat, kv=kv,
                      peak_memory_bytes=int(3.25 * 2**30), peak_memory_hwm_bytes=int(3.06 * 2**30))
    assert summary(s).endswith("serving peak 3.06 GiB")


def test_a_model_whose_engine_refused_its_budget_is_refused_by_validate_next_time(tmp_path, monkeypatch):
    """The runtime moves with the model (gemma3-270m's engine held 2.5 GiB besides its weights where the
    default model's held 0.9): once an engine of a model refused its budget, validate uses that model's
    runtime, and says no before any engine starts; other models keep the host's figure."""
    from pipeline.measure import overhead
    from pipeline.run import preflight

    r, p, model = _budget_recipe(tmp_path, monkeypatch, 2.5)
    preflight.check_budget(r, p, model)  # the prior's runtime leaves room
    overhead.record_refusal("float32", overhead.model_label(r), 2 * 2**30)
    with pytest.raises(preflight.PreflightError, match="engine runtime 2.00 GiB"):
        preflight.check_budget(r, p, model)
    assert overhead.host_figures("float32", "another-model")["runtime_bytes"] == overhead.PRIOR["runtime_bytes"]
    assert "refused its budget" in overhead.host_figures("float32", overhead.model_label(r))["source"]


def test_one_models_figures_never_resize_anothers(tmp_path, monkeypatch):
    """Found when a gemma3-270m run (runtime 2.5 GiB, API server 1.9 GiB) raised the host's figures and every
    later run of the default model on that host failed validate on its 4 GiB budget."""
    from pipeline.measure import overhead

    monkeypatch.setenv("QUANTIZE_EVAL_HOME", str(tmp_path / "home"))
    heavy = {"outside_bytes": int(1.9 * 2**30), "runtime_bytes": int(2.5 * 2**30)}
    overhead.record("float32", heavy, 2**26, "baseline", "gemma3-270m")
    assert overhead.host_figures("float32", "gemma3-270m")["runtime_bytes"] == heavy["runtime_bytes"]
    assert overhead.host_figures("float32", "gemma3-270m")["outside_bytes"] == heavy["outside_bytes"]
    light = overhead.host_figures("float32", "smollm2-135m-instruct")
    assert (light["outside_bytes"], light["runtime_bytes"]) == (overhead.PRIOR["outside_bytes"],
                                                                 overhead.PRIOR["runtime_bytes"])
    first = overhead.for_run(tmp_path / "run", "float32", log=lambda m: None, model="smollm2-135m-instruct")
    assert first["outside_bytes"] == overhead.PRIOR["outside_bytes"]
