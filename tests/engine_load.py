"""Load a checkpoint in the real vLLM engine, generate a few tokens, say what happened.

    python tests/engine_load.py MODEL_DIR KV_CACHE_DTYPE QUANTIZATION OUT.json [DTYPE]

OUT gets ok, the error (last exception line), the GEMM kernels vLLM selected, the KV
blocks it allocated and the text. Its own process: a failed engine must not take the test
runner down, and every vLLM driver script needs a main guard (spawn start method).
"""

from __future__ import annotations

import json
import os
import re
import sys


def main(model: str, kv: str, quant: str, out: str, dtype: str = "float32") -> None:
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    result = {"ok": False, "error": None, "blocks": None, "text": None}
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model, dtype=dtype, enforce_eager=True, max_model_len=256, max_num_seqs=4,
                  kv_cache_memory_bytes=64 << 20, kv_cache_dtype=kv,
                  quantization=None if quant == "none" else quant, seed=0)
        result["blocks"] = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, ignore_eos=True,
                                                                          temperature=0))
        result["text"] = outs[0].outputs[0].text
        result["tokens"] = len(outs[0].outputs[0].token_ids)
        result["ok"] = result["tokens"] == 8
    except Exception as exc:  # the point is to record it
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
    with open(out, "w") as f:
        json.dump(result, f)


def selected_kernels(log: str) -> list[str]:
    return sorted(set(re.findall(r"Selected (\w+) for", log)))


if __name__ == "__main__":
    main(*sys.argv[1:6])
    sys.stdout.flush()
    os._exit(0)  # engine teardown has crashed after results before (exit 134): don't wait on it
