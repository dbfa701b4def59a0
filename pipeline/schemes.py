"""The quantization schemes a variant can name, one row each: who produces the weights, in what format.

Standard library only: the recipe schema (pipeline/recipe/schema.py), the support matrix
(pipeline/support.py), the engine command line and the quantize worker (which runs in the
quantize environment, pipeline/engines/quantize_worker.py) all read this one table.
"""

from __future__ import annotations

from dataclasses import dataclass

# who writes the weights a variant is served with
PRODUCERS = (
    "llm-compressor",  # quantized offline by llm-compressor `oneshot` (quantize worker)
    "transformers",  # quantized offline by transformers (bitsandbytes LLM.int8)
    "vllm",  # quantized by vLLM as it loads the base weights
    "none",  # the base weights (a KV-cache-only variant)
    "import",  # an existing checkpoint (variant field checkpoint:)
    "custom",  # the user's own llm-compressor recipe (variant field recipe:)
)


@dataclass(frozen=True)
class Scheme:
    name: str
    producer: str  # one of PRODUCERS
    weight_bits: int | None  # None: the base model's (none) or the checkpoint's (import, custom)
    takes_group_size: bool  # integer weights in groups of `group_size` (or per channel)
    weight_format: str | None  # what the support matrix decides on (support.WEIGHT_FORMATS); None: read
    #                            from the checkpoint's config.json (import, custom)
    description: str  # one line, for the recipe schema
    symmetric: bool | None = None  # grouped integer weights: a grid symmetric around zero
    llmc_preset: str | None = None  # llm-compressor's preset scheme name, where the scheme is one
    engine_args: tuple[str, ...] = ()  # what it adds to the engine command line

    @property
    def offline(self) -> bool:
        """Is a checkpoint written (by llm-compressor or transformers) before the engine starts?"""
        return self.producer in ("llm-compressor", "transformers", "custom")

    @property
    def calibrates_kv(self) -> bool:
        """Can llm-compressor add calibrated FP8 K/V scales (kv_cache: fp8_calibrated)? With its own
        schemes, or alone on the base weights (none)."""
        return self.producer in ("llm-compressor", "none")


def _w4(name: str, symmetric: bool, description: str) -> Scheme:
    return Scheme(name, "llm-compressor", 4, True, "wna16", description, symmetric=symmetric)


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    _w4("awq_w4a16", False, "4-bit weights, asymmetric, AWQ channel rescaling then rounding (llm-compressor)"),
    _w4("gptq_w4a16", True, "4-bit weights, symmetric, GPTQ error-compensating rounding (llm-compressor)"),
    _w4("rtn_w4a16", True, "4-bit weights, symmetric, rounded to nearest (llm-compressor)"),
    Scheme("w8a8_int8", "llm-compressor", 8, False, "w8a8_int8", "SmoothQuant + GPTQ INT8 weights, dynamic "
           "per-token INT8 activations (llm-compressor)", llmc_preset="W8A8"),
    Scheme("fp8_block", "llm-compressor", 8, False, "fp8_block", "FP8 weights in 128x128 blocks, dynamic FP8 "
           "activations per 128-group (llm-compressor)", llmc_preset="FP8_BLOCK"),
    Scheme("fp8_dynamic", "llm-compressor", 8, False, "fp8_channel", "FP8 per-channel weights, dynamic "
           "per-token activations (llm-compressor)", llmc_preset="FP8_DYNAMIC"),
    Scheme("bnb_nf4", "vllm", 4, False, "bnb", "bitsandbytes NF4, quantized by vLLM at load",
           engine_args=("--quantization", "bitsandbytes")),
    Scheme("bnb_int8", "transformers", 8, False, "bnb", "bitsandbytes LLM.int8 (pre-quantized by transformers)"),
    Scheme("none", "none", None, False, "dense", "weights as the baseline (for KV-cache-only variants)"),
    Scheme("import", "import", None, False, None, "an existing checkpoint (checkpoint:)"),
    Scheme("custom", "custom", None, False, None, "your own llm-compressor recipe file (recipe:)"),
)}

NAMES = tuple(SCHEMES)
# the schemes that take a group_size (4-bit integer weights in groups)
W4_SCHEMES = tuple(s.name for s in SCHEMES.values() if s.takes_group_size)


def describe() -> str:
    """Every scheme with its one-line description, for the recipe schema."""
    return "; ".join(f"{s.name}: {s.description}" for s in SCHEMES.values()) + "."


def engine_args(name: str) -> list[str]:
    """What a scheme adds to the engine command line (bnb_nf4: vLLM quantizes as it loads)."""
    return list(SCHEMES[name].engine_args)
