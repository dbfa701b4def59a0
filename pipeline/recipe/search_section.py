"""The `search:` section of a recipe: which mixed-precision variants `quantize-eval search` may build.

Part of recipe schema v1 (pipeline/recipe/schema.py holds it as Recipe.search). The gates the candidates
must pass are the recipe's own gates; pipeline/search/ladder.py runs the search.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.recipe.serving import Strict

BASE_SCHEMES = ("awq_w4a16", "gptq_w4a16", "rtn_w4a16")
# what a part kept at higher precision becomes: 8-bit integer weights per channel (16-bit activations),
# or the base model's own weights. W8A8-INT8 is not offered per part: where the 4-bit kernel is missing
# the mixed checkpoint is served as dense weights, which would drop its activation quantization.
FALLBACKS = ("w8a16", "unquantized")
FALLBACK_BITS = {"w8a16": 8, "unquantized": 16}
ANCHORS = ("auto_round", "modelopt")


def group_size_rule(v: int | None) -> int | None:
    """A 4-bit weight group: a power of two >= 16, or None for per channel (variants and the search)."""
    if v is not None and (v < 16 or v & (v - 1)):
        raise ValueError("group_size must be a power of two >= 16, or null for per-channel")
    return v


class SensitivitySpec(Strict):
    """How sensitivity is measured: drift-corpus windows held out from the drift suite's own windows."""

    windows: int = Field(4, ge=1, le=256, description="Token windows of the drift corpus scored per part.")
    window_tokens: int = Field(512, ge=16, le=8192, description="Tokens per window.")
    method: Literal["calibrated", "rtn"] = Field(
        "calibrated", description="calibrated: run the base scheme's own llm-compressor recipe in memory first "
        "and measure what it leaves in each part (AWQ fixes most of q/k/v's rounding error, none of o_proj's), "
        "plus an emulated curve of the top parts kept that guesses the first k; rtn: each part rounded to "
        "nearest (faster, blind to what the algorithm fixes).")
    kinds: bool = Field(True, description="Also measure each Linear kind (every q_proj, every down_proj, ...) "
                        "across all blocks: shown in the report, and candidates of units: blocks_and_kinds keep them.")


class SearchSpec(Strict):
    """Mixed precision by measured sensitivity: the k most sensitive parts (units) kept at the fallback
    precision, the rest at the base scheme; k found by bisection toward the cheapest candidate whose gates
    pass. Every candidate is a real llm-compressor checkpoint, evaluated and signed off like a variant."""

    base_scheme: Literal[BASE_SCHEMES] = Field(  # type: ignore[valid-type]
        "gptq_w4a16", description="The 4-bit scheme most blocks get: " + ", ".join(BASE_SCHEMES) + ".")
    group_size: int | None = Field(64, description="The base scheme's weight group size; null = per channel.")
    fallbacks: tuple[str, ...] = Field(
        ("w8a16",), min_length=1, description="Precisions a kept block may take, cheapest first: "
        + ", ".join(FALLBACKS) + ". The search tries them in this order and stops at the first that passes.")
    units: Literal["blocks", "blocks_and_kinds", "block_kinds"] = Field(
        "blocks_and_kinds", description="What a candidate keeps at the fallback: whole decoder blocks; blocks "
        "and Linear kinds (every q/k/v, every down_proj, ...); or block_kinds, each input-sharing group of Linear "
        "kinds within each block (q/k/v of block 11, down_proj of block 29: four times the parts to measure, "
        "and the bytes go where the drift is). Each part is ranked by its measured sensitivity per weight it "
        "would keep; parts that overlap count once.")
    objective: Literal["memory", "capacity", "latency"] = Field(
        "memory", description="memory: the smallest weights as loaded (as a native kernel holds them, in "
        "the model's dtype); capacity: the most KV tokens under engine.memory_budget_gib; latency: the lowest "
        "p95 TPOT of the workload's cell, at the upper end of its 95% interval over workload.repeats (as a latency "
        "gate reads it), measured only where the engine runs the candidates' kernels natively: where it serves "
        "them as dense weights the search stops after the uniform candidate and says so.")
    max_builds: int = Field(6, ge=1, le=64, description="Cap on candidate checkpoints built (the uniform base "
                            "scheme counts as one); the search stops there and reports the best that passed.")
    kv_cache: tuple[Literal["auto", "fp8"], ...] = Field(
        ("auto",), min_length=1, description="KV-cache precisions in the space: each candidate that passes on the "
        "search data is also served with each one (fp8: the engine's kv_cache_dtype=fp8 over the same checkpoint, "
        "about twice the KV tokens under the budget where the engine runs it natively). Served, not built: they "
        "do not count against max_builds. objective: capacity can then pick one; memory cannot tell them apart.")
    split_seed: int = Field(0, ge=0, description="Which half of the quality data the search reads (its ladder "
                            "chooses on it) and which half, never read by the search, signs the answer off (sealed): "
                            "each suite's items and the drift corpus's essays cut in two by this seed; code windows "
                            "(quality.drift.code_windows) are sealed whatever the seed.")
    anchors: tuple[Literal[ANCHORS], ...] = Field(  # type: ignore[valid-type]
        (), description="Head-to-head: after the ladder, each anchor tool chooses which decoder Linear layers get "
        "8-bit weights at the same average bits as the search data's pick (counted the tool's own way), and that "
        "choice is built by the search's own base scheme and judged through the same halves and gates. Compared, "
        "never the answer; a build each, outside max_builds. auto_round: Intel auto-round's AutoScheme (in the "
        "quantize environment); modelopt: NVIDIA ModelOpt's auto_quantize with its INT4 AWQ and INT8 weight-only "
        "formats (installed into the quantize environment on first use; its NVFP4 formats need CUDA).")
    sensitivity: SensitivitySpec = SensitivitySpec()

    @model_validator(mode="after")
    def _kinds_measured(self) -> SearchSpec:
        if self.units == "blocks_and_kinds" and not self.sensitivity.kinds:  # block_kinds measures its own
            raise ValueError("units: blocks_and_kinds needs sensitivity.kinds: true (the kinds must be measured)")
        return self

    _group = field_validator("group_size")(classmethod(lambda cls, v: group_size_rule(v)))

    @field_validator("fallbacks")
    @classmethod
    def _fallbacks(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for f in v:
            if f == "w8a8_int8":
                raise ValueError("w8a8_int8 is not offered per block: where the 4-bit kernel is missing the mixed "
                                 "checkpoint is served as dense weights, which would drop its activation "
                                 "quantization; use w8a16 or unquantized")
            if f not in FALLBACKS:
                raise ValueError(f"unknown fallback {f!r}; one of {', '.join(FALLBACKS)}")
        if len(set(v)) != len(v):
            raise ValueError("a fallback is listed twice")
        return v

    @model_validator(mode="after")
    def _anchors_choose_8_bit(self) -> SearchSpec:
        if self.anchors and "w8a16" not in self.fallbacks:
            raise ValueError("anchors choose between the base 4-bit scheme and 8-bit weights: they need w8a16 "
                             "among the fallbacks")
        if len(set(self.anchors)) != len(self.anchors):
            raise ValueError("an anchor is listed twice")
        return self

    @field_validator("kv_cache")
    @classmethod
    def _kv(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if "auto" not in v:
            raise ValueError("kv_cache must include auto: the candidates are built and judged on the baseline's KV "
                             "cache first, and fp8 is tried on those that pass")
        if len(set(v)) != len(v):
            raise ValueError("a KV-cache precision is listed twice")
        return v
