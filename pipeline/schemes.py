"""The quantization schemes a variant can name, one row each: who produces the weights, in what format,
with which llm-compressor modifiers.

Standard library only: the recipe schema (pipeline/recipe/schema.py), the support matrix
(pipeline/engines/vllm/support.py), the engine command line, the quantize worker (which runs in the quantize
environment, pipeline/engines/workers/quantize_worker.py) and the search's mixed candidates
(pipeline/search/mixed.py) all read this one table. Adding a scheme is a row here and its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def weight_args(bits: int, group_size: int | None, symmetric: bool) -> dict:
    """compressed-tensors' weight arguments for integer weights in groups (None: per output channel)."""
    w = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False}
    if group_size is None:
        w["strategy"] = "channel"
    else:
        w.update(strategy="group", group_size=group_size)
    return w


# per-tensor FP8 K/V scales observed on the calibration set (kv_cache: fp8_calibrated)
KV_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


# Each builder takes the quantization body (targets, ignore, and the weights' config groups or a preset
# scheme, and calibrated KV scales) and the variant's settings, and returns llm-compressor's modifiers.
def _awq(q: dict, settings: dict) -> dict:
    # AWQ only rescales channels; the quantization modifier after it does the rounding
    # (targets/ignore/scheme under AWQModifier itself are rejected in llm-compressor 0.14)
    return {"AWQModifier": {"duo_scaling": True}, "QuantizationModifier": q}


def _gptq(q: dict, settings: dict) -> dict:
    return {"GPTQModifier": {**q, "dampening_frac": 0.01}}


def _round(q: dict, settings: dict) -> dict:
    return {"QuantizationModifier": q}


# Gemma 2 and 3 put a norm on each sublayer's output too ("sandwich" norms): post_attention_layernorm
# scales the attention's output before the residual add, and the MLP reads pre_feedforward_layernorm.
# llm-compressor's default SmoothQuant mappings, which it lists for these models, pair gate/up with
# post_attention_layernorm, so smoothing rescales a tensor the MLP never reads and changes the model instead
# of moving outliers. Its own offset-norm handling makes the (1 + w) norms safe to smooth.
SANDWICH_NORMS = ("gemma2", "gemma3", "gemma3_text")
SANDWICH_MAPPINGS = [[["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
                     [["re:.*gate_proj", "re:.*up_proj"], "re:.*pre_feedforward_layernorm"]]


def _smoothquant_gptq(q: dict, settings: dict) -> dict:
    # SmoothQuant moves activation outliers into the weights, then GPTQ rounds INT8 per-channel weights;
    # activations are quantized per token at run time (dynamic)
    sq = {"smoothing_strength": settings.get("smoothing_strength", 0.8)}
    if settings.get("model_type") in SANDWICH_NORMS:
        sq["mappings"] = SANDWICH_MAPPINGS
    return {"SmoothQuantModifier": sq, **_gptq(q, settings)}

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
    load_quantization: str | None = None  # the engine quantizes the base weights as it loads them, this way
    modifiers: Callable[[dict, dict], dict] | None = None  # llm-compressor modifiers (llm-compressor producers)

    @property
    def offline(self) -> bool:
        """Is a checkpoint written (by llm-compressor or transformers) before the engine starts?"""
        return self.producer in ("llm-compressor", "transformers", "custom")

    @property
    def imports_checkpoint(self) -> bool:
        """Are the weights an existing checkpoint (variant field checkpoint:), its format read from it?"""
        return self.producer == "import"

    @property
    def user_recipe(self) -> bool:
        """Are the weights written by the user's own llm-compressor recipe, the format known once written?"""
        return self.producer == "custom"

    @property
    def calibrates_kv(self) -> bool:
        """Can llm-compressor add calibrated FP8 K/V scales (kv_cache: fp8_calibrated)? With its own
        schemes, or alone on the base weights (none)."""
        return self.producer in ("llm-compressor", "none")


def _w4(name: str, symmetric: bool, description: str, modifiers) -> Scheme:
    return Scheme(name, "llm-compressor", 4, True, "wna16", description, symmetric=symmetric, modifiers=modifiers)


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    _w4("awq_w4a16", False, "4-bit weights, asymmetric, AWQ channel rescaling then rounding (llm-compressor)", _awq),
    _w4("gptq_w4a16", True, "4-bit weights, symmetric, GPTQ error-compensating rounding (llm-compressor)", _gptq),
    _w4("rtn_w4a16", True, "4-bit weights, symmetric, rounded to nearest (llm-compressor)", _round),
    Scheme("w8a8_int8", "llm-compressor", 8, False, "w8a8_int8", "SmoothQuant + GPTQ INT8 weights, dynamic "
           "per-token INT8 activations (llm-compressor)", llmc_preset="W8A8", modifiers=_smoothquant_gptq),
    Scheme("fp8_block", "llm-compressor", 8, False, "fp8_block", "FP8 weights in 128x128 blocks, dynamic FP8 "
           "activations per 128-group (llm-compressor)", llmc_preset="FP8_BLOCK", modifiers=_round),
    Scheme("fp8_dynamic", "llm-compressor", 8, False, "fp8_channel", "FP8 per-channel weights, dynamic "
           "per-token activations (llm-compressor)", llmc_preset="FP8_DYNAMIC", modifiers=_round),
    Scheme("bnb_nf4", "vllm", 4, False, "bnb", "bitsandbytes NF4, quantized by vLLM at load",
           load_quantization="bitsandbytes"),
    Scheme("bnb_int8", "transformers", 8, False, "bnb", "bitsandbytes LLM.int8 (pre-quantized by transformers)"),
    Scheme("none", "none", None, False, "dense", "weights as the baseline (for KV-cache-only variants)",
           modifiers=_round),  # calibrated FP8 K/V scales alone
    Scheme("import", "import", None, False, None, "an existing checkpoint (checkpoint:)"),
    Scheme("custom", "custom", None, False, None, "your own llm-compressor recipe file (recipe:)"),
)}

NAMES = tuple(SCHEMES)
# the schemes that take a group_size (4-bit integer weights in groups)
W4_SCHEMES = tuple(s.name for s in SCHEMES.values() if s.takes_group_size)


def describe() -> str:
    """Every scheme with its one-line description, for the recipe schema."""
    return "; ".join(f"{s.name}: {s.description}" for s in SCHEMES.values()) + "."


def llmc_recipe(name: str, ignore: list[str], group_size: int | None = None, kv_cache: str = "auto",
                smoothing_strength: float = 0.8, model_type: str | None = None) -> dict:
    """The llm-compressor recipe for a scheme, as the YAML mapping oneshot reads. kv_cache "fp8_calibrated"
    adds per-tensor FP8 K/V scales observed on the calibration set to the last quantization modifier
    (alone when the scheme is "none"). model_type: the model config's, where a scheme depends on the
    architecture (SmoothQuant on Gemma 2/3's sandwich norms)."""
    s = SCHEMES.get(name)
    kv = {"kv_cache_scheme": KV_FP8} if kv_cache == "fp8_calibrated" else {}
    if s is None or s.modifiers is None or (s.producer == "none" and not kv):
        raise ValueError(f"scheme {name!r} (kv_cache={kv_cache!r}) has no llm-compressor recipe")
    if s.producer == "none":
        q = dict(kv)
    elif s.takes_group_size:
        q = {"targets": ["Linear"], "ignore": list(ignore), "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": weight_args(s.weight_bits, group_size, s.symmetric)}}, **kv}
    else:
        q = {"targets": ["Linear"], "ignore": list(ignore), "scheme": s.llmc_preset, **kv}
    return {"quant_stage": {"quant_modifiers": s.modifiers(q, {"smoothing_strength": smoothing_strength,
                                                               "model_type": model_type})}}
