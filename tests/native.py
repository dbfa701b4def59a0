"""The quantized variant a multi-variant integration test can run on whichever CPU kind CI drew.

The Ray tests need a second variant that is quantized by llm-compressor and served by the engine.
No one scheme is native everywhere: W8A8-INT8 is native on AVX-512 without AMX and on Zen 5, AMX's
INT8 kernel takes only 16-bit activations, and on the AVX2 kind the engine's INT8 product is wrong
(its probe refuses it) and no quantized format runs natively at all. So each test asks the support
matrix, as the run itself will, and checks systems figures only where the variant's are measured.
"""

from __future__ import annotations

import json
from pathlib import Path


def eight_bit_variant(model: Path, name: str, dtype: str = "float32") -> dict:
    """W8A8-INT8 where this host's engine computes it natively in `dtype`; else an FP8 KV cache with
    calibrated scales (AMX in float32); else, where nothing quantized is native (AVX2), a W4A16 checkpoint
    the run serves emulated (quality measured on its dequantized weights, systems not), rounded to nearest
    in groups of 128: the Ray test quantizes it once per run under another seed, and a calibrated 4-bit
    scheme (GPTQ) then gives two checkpoints whose log-likelihoods differ beyond the test's tolerance;
    rounding gives the same one."""
    from pipeline.engines import formats
    from pipeline.engines.vllm import support

    cfg = json.loads((model / "config.json").read_text())
    if support.decide(formats.scheme_format("w8a8_int8", "auto"), cfg, dtype=dtype).mode == "native":
        return {"name": name, "scheme": "w8a8_int8"}
    if support.decide(formats.scheme_format("none", "fp8_calibrated"), cfg, dtype=dtype).mode == "native":
        return {"name": name, "scheme": "none", "kv_cache": "fp8_calibrated"}
    return {"name": name, "scheme": "rtn_w4a16", "group_size": 128}


def systems_measured(variant_dir: Path) -> bool:
    """Did the run measure this variant's systems (native), or say why not (emulated)?"""
    support = variant_dir / "support.json"
    return not support.exists() or json.loads(support.read_text())["mode"] == "native"
