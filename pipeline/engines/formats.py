"""Formats a variant's weights take, read from a scheme or a checkpoint, and the decision an engine
gives on one: engine-neutral, so each engine kind (pipeline/engines/<kind>/) answers in these terms.

A Format is what would be loaded (weights: one of WEIGHT_FORMATS; an FP8 KV cache or not); a
Decision is how this engine on this host would run it: native, emulated (4-bit kernel missing:
quality from dequantized weights, systems not measured) or unsupported (SKIPPED with the reason),
and the compute path it really takes (a "W4A16" computed as W4A8 is a different number).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline import schemes

# formats a variant's weights can take once quantized
WEIGHT_FORMATS = ("dense", "wna16", "w8a8_int8", "fp8_block", "fp8_channel", "fp8_tensor", "bnb")


@dataclass(frozen=True)
class Format:
    weights: str  # one of WEIGHT_FORMATS
    kv_fp8: bool = False
    detail: str = ""  # what was read to decide (scheme name or checkpoint config)
    legacy: bool = False  # a GPTQ/AWQ-format checkpoint (its own packing, not compressed-tensors)


@dataclass(frozen=True)
class Decision:
    mode: str  # native | emulated | unsupported
    platform: str
    reason: str
    compute: str = ""  # the precision the engine computes in: W4A16, W4A8, W8A8-INT8, W8A16-FP8, W8A8-FP8, dense
    activations: str = ""  # what the activations are in that product (e.g. "bfloat16", "int8 per token")
    # emulated by the engine as it loads the checkpoint, so no dense copy is served in its place
    engine_dequantizes: bool = False


# the variant field `activations`: what the scheme names, or the engine's own W4A8 path for 4-bit weights
ACTIVATIONS = ("auto", "int8")


def scheme_format(scheme: str, kv_cache: str) -> Format:
    """The format a scheme's weights take (pipeline/schemes.py); import and custom are read from the
    checkpoint instead (checkpoint_format)."""
    weights = schemes.SCHEMES[scheme].weight_format
    if weights is None:
        raise ValueError(f"scheme {scheme}: the format is read from its checkpoint (checkpoint_format)")
    return Format(weights, kv_cache != "auto", f"scheme {scheme}, kv_cache {kv_cache}")


def checkpoint_format(config: dict) -> Format:
    """Read a checkpoint's config.json quantization_config (any producer) into a Format."""
    qc = config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if not qc:
        return Format("dense", False, "no quantization_config")
    if method in ("gptq", "awq", "auto_gptq"):
        return Format("wna16", False, f"{method} {qc.get('bits')}-bit g{qc.get('group_size')}", legacy=True)
    if method == "bitsandbytes":
        return Format("bnb", False, "bitsandbytes")
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config.quant_method {method!r} is not a format this pipeline reads")
    kv = bool(qc.get("kv_cache_scheme"))
    fmts = set()
    for group in (qc.get("config_groups") or {}).values():
        w, a = group.get("weights") or {}, group.get("input_activations")
        if not w:
            continue
        if w.get("type") == "int" and not a:
            fmts.add("wna16")
        elif w.get("type") == "int" and w.get("num_bits") == 8 and a and a.get("dynamic"):
            fmts.add("w8a8_int8")
        elif w.get("type") == "float" and w.get("num_bits") == 8:
            if w.get("strategy") == "block":
                fmts.add("fp8_block")
            elif a and not a.get("dynamic"):
                fmts.add("fp8_tensor")  # static activation scales
            else:
                fmts.add("fp8_channel")
        else:
            raise ValueError(f"compressed-tensors weights {w.get('type')}{w.get('num_bits')} with activations "
                             f"{a} are not a format this pipeline knows how to check")
    if len(fmts) > 1:  # mixed schemes: judged by the hardest part
        order = ["fp8_tensor", "fp8_channel", "fp8_block", "w8a8_int8", "wna16"]
        fmts = {next(f for f in order if f in fmts)}
    weights = fmts.pop() if fmts else "dense"
    return Format(weights, kv, f"compressed-tensors {weights}{' + fp8 kv' if kv else ''}")
