"""One mixed-precision candidate as an llm-compressor recipe: most Linear layers at the base 4-bit scheme,
the kept ones at the fallback precision, in one compressed-tensors config vLLM loads.

Standard library only (the search writes these files; the quantize worker runs them as any user's
`scheme: custom` recipe). Targets are exact module names, anchored, so compressed-tensors and vLLM
match each Linear to one group and no other module type is touched.
"""

from __future__ import annotations

import re

from pipeline import schemes
from pipeline.schemes import weight_args


def names_regex(names: list[str]) -> str:
    """A compressed-tensors target that matches exactly these module names."""
    return "re:^(?:" + "|".join(re.escape(n) for n in sorted(names)) + ")$"


def candidate_recipe(base_scheme: str, group_size: int | None, fallback: str, quantized: list[str],
                     kept: list[str], ignore: list[str]) -> dict:
    """The llm-compressor recipe (the YAML mapping oneshot reads) for: `quantized` Linear names at the
    base scheme, `kept` at `fallback` (w8a16: 8-bit symmetric per-channel weights; unquantized: ignored),
    `ignore` (e.g. lm_head) untouched. With nothing kept it is the uniform base scheme."""
    s = schemes.SCHEMES[base_scheme]
    if not quantized and fallback != "w8a16":
        raise ValueError("every module kept unquantized is the base model, not a candidate")
    groups = {"group_0": {"targets": [names_regex(quantized)],
                          "weights": weight_args(s.weight_bits, group_size, s.symmetric)}} if quantized else {}
    skip = list(ignore)
    if kept and fallback == "w8a16":
        groups[f"group_{len(groups)}"] = {"targets": [names_regex(kept)], "weights": weight_args(8, None, True)}
    elif kept and fallback == "unquantized":
        skip += sorted(kept)
    elif kept:
        raise ValueError(f"unknown fallback {fallback!r}")
    if not s.takes_group_size or s.modifiers is None:
        raise ValueError(f"{base_scheme!r} is not a 4-bit base scheme")
    return {"quant_stage": {"quant_modifiers": s.modifiers({"ignore": skip, "config_groups": groups}, {})}}


def describe_parts(parts: list[str]) -> str:
    """What a candidate keeps, for people: 'blocks 29, 11; every down_proj; q_proj+k_proj+v_proj in blocks
    3, 7' from part names 'model.layers.29', 'down_proj', 'model.layers.3:q_proj+k_proj+v_proj'."""
    blocks: list[str] = []
    kinds: list[str] = []
    per_block: dict[str, list[str]] = {}
    for p in parts:
        if ":" in p:
            block, group = p.split(":", 1)
            per_block.setdefault(group, []).append(block.rsplit(".", 1)[-1])
        elif ".layers." in p:
            blocks.append(p.rsplit(".", 1)[-1])
        else:
            kinds.append(p)
    out = [f"block{'s' if len(blocks) > 1 else ''} {', '.join(blocks)}"] if blocks else []
    out += [f"every {k}" for k in kinds]
    out += [f"{g} in block{'s' if len(bs) > 1 else ''} {', '.join(bs)}" for g, bs in per_block.items()]
    return "; ".join(out) or "nothing"


def describe_modules(names: list[str]) -> str:
    """Linear layers by kind, for people: 'q_proj in blocks 0, 3; down_proj in block 29' from full module names
    such as 'model.layers.3.self_attn.q_proj' (an anchor's choice is per layer, not per ranked part)."""
    per_kind: dict[str, list[int]] = {}
    for n in names:
        parts = n.split(".")
        block = next((int(parts[i + 1]) for i, p in enumerate(parts[:-1]) if p == "layers" and parts[i + 1].isdigit()),
                     None)
        per_kind.setdefault(parts[-1], []).append(block)
    out = []
    for kind, blocks in per_kind.items():
        known = sorted(b for b in blocks if b is not None)
        out.append(f"{kind} in block{'s' if len(known) > 1 else ''} {', '.join(map(str, known))}" if known else kind)
    return "; ".join(out) or "nothing"
