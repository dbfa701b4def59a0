"""transformers behind the engine interface (pipeline/engines/interface.py): the reference engine.

A second, independent engine that checks the first. It loads the same checkpoints (compressed-tensors ones
through compressed-tensors' own decompression) and answers lm-eval's requests one prompt at a time in the
engine dtype (serve.py, in the engine environment: transformers and compressed-tensors come with vLLM).
It measures no memory, capacity or latency: it has no KV pool to size and no batching worth timing.

serve.py    the process: the model, the OpenAI completions endpoint
server.py   starts, watches and reaps that process (interface.Engine)
"""

from __future__ import annotations

from pipeline.engines.formats import Decision
from pipeline.engines.interface import Launch
from pipeline.engines.transformers import server

# what transformers loads here: dense weights and compressed-tensors checkpoints, which compressed-tensors
# decompresses to the engine dtype (quantize-dequantize of activations where the scheme quantizes them)
LOADS = ("dense", "wna16", "w8a8_int8", "fp8_block", "fp8_channel", "fp8_tensor")


def launch(spec: Launch) -> server.Server:
    """An engine for this launch; enter it to start it (interface.Engine)."""
    return server.Server(spec)


def numerics_env(compute: str = "") -> dict[str, str]:
    return {}


def prestart(wait: bool = False) -> float | None:
    """Nothing to begin: a reference engine starts once per variant, importing transformers itself."""
    return None


def placement() -> dict[str, str]:
    return {"reference": "transformers, one process, one prompt per forward pass"}


def capabilities() -> dict:
    return {}


def decide(fmt, model_cfg: dict, caps: dict | None = None, dtype: str = "float32", activations: str = "auto"):
    if fmt.kv_fp8:
        return Decision("unsupported", "transformers", "FP8 KV cache: the reference engine keeps it in the engine dtype")
    if fmt.legacy:
        return Decision("unsupported", "transformers", f"{fmt.detail}: a GPTQ/AWQ-format checkpoint needs a kernel "
                        "package the reference engine lacks")
    if fmt.weights not in LOADS:
        return Decision("unsupported", "transformers", f"{fmt.weights}: not a format the reference engine loads")
    if fmt.weights == "dense":
        return Decision("native", "transformers", "dense weights", compute="dense", activations=dtype)
    return Decision("emulated", "transformers", f"{fmt.weights}: decompressed by compressed-tensors to {dtype}",
                    compute="dense", activations=dtype, engine_dequantizes=True)


def architectures() -> set[str] | None:
    return None


def systems_not_measured() -> str | None:
    return "the reference engine (transformers) measures no memory, capacity or latency"


def native_on(weights: str) -> str:
    return "a serving engine (engine.kind: vllm) where it runs the scheme; the reference engine decompresses every one"
