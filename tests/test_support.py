"""Both branches of every hardware decision, whatever this machine's CPU kind.

The engine's answers (pipeline/engines/support_probe.py) are replaced by recorded ones
(tests/fixtures/support/: this kind's as the engine gave them, the other kinds' reconstructed
and labelled so), so native, emulated and SKIPPED are each decided here on any machine. The
tests that load every scheme in the real engine (test_schemes.py) keep asserting what this
host's own probe says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import support

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "support"
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
           "num_hidden_layers": 30}  # head size 64
TILED = {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_hidden_layers": 4}  # every Linear a multiple of 128, head size 128

# (answers, scheme, kv_cache, model) -> mode, for an engine computing in float32 (bfloat16: below)
EXPECTED = [
    ("cpu-avx2", "awq_w4a16", "auto", SMOLLM2, "emulated"),
    ("cpu-avx512", "awq_w4a16", "auto", SMOLLM2, "emulated"),  # the kernel has no float32 path
    ("cpu-avx2", "w8a8_int8", "auto", SMOLLM2, "native"),
    ("cpu-avx512", "w8a8_int8", "auto", SMOLLM2, "native"),
    ("cpu-avx2", "none", "fp8", SMOLLM2, "unsupported"),
    ("cpu-avx512", "none", "fp8", SMOLLM2, "native"),
    ("cpu-avx512", "w8a8_int8", "fp8_calibrated", SMOLLM2, "native"),
    ("cpu-avx512", "fp8_block", "auto", SMOLLM2, "unsupported"),  # 576 is not a multiple of 128
    ("cpu-avx512-amx", "fp8_block", "auto", TILED, "native"),
    ("cpu-avx512", "fp8_block", "auto", TILED, "unsupported"),  # no AMX
    ("cpu-avx512", "fp8_dynamic", "auto", TILED, "unsupported"),
    ("cpu-avx2", "bnb_nf4", "auto", SMOLLM2, "unsupported"),
    ("cpu-avx512", "bnb_int8", "auto", SMOLLM2, "unsupported"),
    # AMD EPYC Zen 5 (AVX512-BF16, no AMX), as its engine answered: FP8 KV yes, FP8 weights need AMX
    ("cpu-avx512-bf16", "w8a8_int8", "fp8_calibrated", SMOLLM2, "native"),
    ("cpu-avx512-bf16", "fp8_block", "auto", TILED, "unsupported"),
    ("cpu-avx512-bf16", "fp8_dynamic", "auto", TILED, "unsupported"),
]


def answers(name: str) -> dict:
    return support.recorded_answers(FIXTURES / f"{name}.json")


@pytest.mark.parametrize("kind,scheme,kv,cfg,mode", EXPECTED,
                         ids=[f"{e[0]}-{e[1]}-{e[2]}-{'smollm2' if e[3] is SMOLLM2 else 'tiled'}" for e in EXPECTED])
def test_decisions_from_recorded_answers(kind, scheme, kv, cfg, mode):
    d = support.decide(support.scheme_format(scheme, kv), cfg, answers(kind))
    assert d.mode == mode, d
    assert f"recorded answers, {kind}.json" in d.platform  # a decision never passes for this machine's


def test_the_4bit_kernel_is_native_in_the_dtypes_it_computes_in():
    for kind, dtype, mode in (("cpu-avx512", "bfloat16", "native"), ("cpu-avx512", "float32", "emulated"),
                              ("cpu-avx2", "bfloat16", "emulated"), ("cpu-avx512-bf16", "bfloat16", "native"),
                              ("cpu-avx512-bf16", "float32", "emulated")):
        d = support.decide(support.scheme_format("gptq_w4a16", "auto"), SMOLLM2, answers(kind), dtype=dtype)
        assert d.mode == mode, (kind, dtype, d)
    d = support.decide(support.scheme_format("gptq_w4a16", "auto"), SMOLLM2, answers("cpu-avx512"))
    assert "not the engine's float32" in d.reason and "bfloat16/float16" in d.reason


def test_reasons_name_what_is_missing():
    emu = support.decide(support.scheme_format("gptq_w4a16", "auto"), SMOLLM2, answers("cpu-avx2"))
    assert "cpu_gemm_wna16" in emu.reason and "AVX2 library" in emu.reason and "systems not measured" in emu.reason
    kv = support.decide(support.scheme_format("none", "fp8"), SMOLLM2, answers("cpu-avx2"))
    assert kv.reason.startswith("FP8 KV cache")
    odd = dict(SMOLLM2, hidden_size=560, num_attention_heads=7)  # head size 80: not a multiple of 32
    kv80 = support.decide(support.scheme_format("none", "fp8"), odd, answers("cpu-avx512"))
    assert kv80.mode == "unsupported" and "divisible by 32" in kv80.reason


def test_the_environment_injects_answers(monkeypatch, tmp_path):
    monkeypatch.setenv(support.ANSWERS_ENV, str(FIXTURES / "cpu-avx2.json"))
    caps = support.capabilities()  # no engine asked
    assert caps["ops"]["cpu_gemm_wna16"] is False and caps["platform_name"].startswith("cpu-avx2 (recorded")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"platform": "cpu"}))
    monkeypatch.setenv(support.ANSWERS_ENV, str(bad))
    with pytest.raises(RuntimeError, match="platform_name"):
        support.capabilities()


def test_this_kinds_fixture_is_what_the_engine_answered():
    """The fixture of the kind a session recorded is the probe's output verbatim (plus its name)."""
    rec = json.loads((FIXTURES / "cpu-avx512.json").read_text())
    assert rec["_source"].startswith("support_probe on") and rec["vllm"] == "0.32.0"
    assert {"methods", "ops", "kernels", "fp8_kv_by_head_size"} <= set(rec)


@pytest.mark.parametrize("cc,fp8,scheme,kv,mode,why", [
    (90, True, "fp8_dynamic", "auto", "native", "FP8 W8A8 kernels"),
    (80, False, "fp8_dynamic", "auto", "native", "weight-only (Marlin W8A16)"),   # Ampere: FP8 weights only
    (70, False, "fp8_dynamic", "auto", "unsupported", "needs compute capability >= 7.5"),
    (80, False, "none", "fp8", "unsupported", "FP8 KV cache"),
    (90, True, "none", "fp8", "native", ""),
    (70, False, "gptq_w4a16", "auto", "unsupported", "needs compute capability >= 7.5"),
    (75, False, "gptq_w4a16", "auto", "native", ""),
    (80, False, "w8a8_int8", "auto", "native", ""),
])
def test_cuda_decisions_come_from_vllms_own_kernel_requirements(cc, fp8, scheme, kv, mode, why):
    """vLLM's classes say what each kernel needs (importable without a GPU); a stand-in device
    capability stands for the GPU."""
    from pipeline.engines.support_probe import cuda_answers

    caps = {**cuda_answers(cc, fp8, bitsandbytes=True), "platform_name": f"cuda (stand-in cc {cc})"}
    assert caps["min_capability"]["wna16"] and caps["min_capability"]["fp8"] >= caps["min_capability"]["wna16"]
    d = support.decide(support.scheme_format(scheme, kv), TILED, caps)
    assert d.mode == mode and why in d.reason, d


def test_bitsandbytes_on_cuda_needs_the_package():
    from pipeline.engines.support_probe import cuda_answers

    caps = {**cuda_answers(90, True, bitsandbytes=False), "platform_name": "cuda (stand-in)"}
    d = support.decide(support.scheme_format("bnb_nf4", "auto"), SMOLLM2, caps)
    assert d.mode == "unsupported" and "not installed" in d.reason
