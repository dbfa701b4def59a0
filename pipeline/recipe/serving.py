"""The serving half of a recipe: the engine every variant shares and the workload it is driven with.

Part of recipe schema v1 (pipeline/recipe/schema.py composes these into a Recipe). EngineSpec is the
controlled experiment: identical for the baseline and every variant, including the memory budget
that decides each engine's KV pool (pipeline/measure/membudget.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.engines import interface

# CPU: room for the default model's float32 weights, the engine's runtime (API server and worker) and a pool
# that holds the default workload (docs/performance.md)
DEFAULT_BUDGET_GIB = 4.0


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSpec(Strict):
    """Engine settings shared by the baseline and every variant: the controlled experiment."""

    kind: str = Field("vllm", description="The serving engine (a folder under pipeline/engines/ that implements "
                      "pipeline/engines/interface.py): " + ", ".join(interface.kinds()) + ".")
    max_model_len: int = Field(2048, ge=64, description="Context length every engine serves.")
    max_num_seqs: int = Field(16, ge=1, le=1024, description="Sequences the scheduler runs at once.")
    memory_budget_gib: float | None = Field(
        None, gt=0, description="CPU: memory each engine's process tree may use, GiB (default "
        f"{DEFAULT_BUDGET_GIB:g} unless kv_cache_gib is set). Each engine sizes its own KV pool to what the budget "
        "leaves after its weights and its runtime, so what quantization frees shows as KV capacity "
        "(pipeline/measure/membudget.py); an engine whose peak goes over the budget has its capacity marked so. "
        "On GPUs the budget is gpu_memory_utilization and vLLM sizes the pool.")
    kv_cache_gib: float | None = Field(
        None, gt=0, description="A fixed KV pool in GiB for every variant instead of a budget (--kv-cache-memory-"
        "bytes; 'same pool' experiments): weight savings then do not show as capacity.")
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=0.98, description="Fraction of GPU memory vLLM may take (GPU only).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Activation dtype. auto: bfloat16 on GPUs and CPUs with native bf16 "
        "(AVX512-BF16/AMX), else float32 (bf16 is emulated there and its prefill much slower: README, Performance).")
    enforce_eager: bool = Field(
        True, description="Skip graph compilation: a faster engine start, since compiled graphs are rebuilt at every "
        "start here.")
    seed: int = Field(0, description="Engine seed.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs one engine spans (--tensor-parallel-size); "
                                      "with the ray executor, the GPUs each variant's evaluation requests.")
    startup_timeout_s: float = Field(600, gt=0, description="Give up on an engine start after this.")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        if v not in interface.kinds():
            raise ValueError(f"{v!r} is not an engine here (one of {', '.join(interface.kinds())})")
        return v

    @model_validator(mode="after")
    def _one_pool_rule(self) -> EngineSpec:
        if self.memory_budget_gib is not None and self.kv_cache_gib is not None:
            raise ValueError("set one of engine.memory_budget_gib (a budget; the default) or engine.kv_cache_gib "
                             "(a fixed pool), not both")
        return self

    @property
    def fixed_pool_bytes(self) -> int | None:
        """The KV pool every engine gets with kv_cache_gib (else None: a budget decides it)."""
        return int(self.kv_cache_gib * 2**30) if self.kv_cache_gib is not None else None

    @property
    def budget_gib(self) -> float | None:
        """The memory budget in GiB, or None with a fixed pool."""
        if self.kv_cache_gib is not None:
            return None
        return self.memory_budget_gib or DEFAULT_BUDGET_GIB


class CellSpec(Strict):
    """One more cell of the workload matrix (same request count, timeout and repeats as the
    primary cell)."""

    prompt_tokens: int = Field(ge=1, description="Prompt length in tokens.")
    output_tokens: int = Field(ge=2, description="Generated tokens per request.")
    concurrency: int = Field(ge=1, le=1024, description="Requests in flight at once.")
    prefix: Literal["unique", "shared"] = Field(
        "unique", description="unique: every prompt distinct (prefix cache cold); shared: every prompt "
        "starts with the same first half (the cache is warm after the first request).")


class WorkloadSpec(Strict):
    """The primary serving cell (gates read it) plus an optional matrix of further cells."""

    prompt_tokens: int = Field(256, ge=1, description="Prompt length in tokens.")
    output_tokens: int = Field(64, ge=2, description="Generated tokens per request (ignore_eos).")
    concurrency: int = Field(4, ge=1, le=1024, description="Requests in flight at once.")
    num_requests: int = Field(32, ge=1, description="Measured requests.")
    warmup_requests: int = Field(4, ge=0, description="Requests sent first and not measured.")
    request_timeout_s: float = Field(300, gt=0, description="A request slower than this is a timeout.")
    repeats: int = Field(4, ge=1, le=10, description="Measure each cell this many times in one engine start; "
                         "latency gates are judged on a 95% t interval over the repeats, which narrows as they grow "
                         "(4: an unchanged variant passes a 1.2x gate at 5% noise per repeat 95% of the time; "
                         "tests/test_gate_simulation.py), and the spread of p50 TPOT is reported.")
    engine_starts: int = Field(1, ge=1, le=10, description="Engine starts the primary cell's repeats are spread "
                               "over (the first start measures everything; each further one restarts the engine and "
                               "measures the primary cell's repeats again). From 2 on both sides, latency gates are "
                               "judged across starts, so the start-to-start spread is inside their interval.")
    slo_ttft_ms: float | None = Field(None, gt=0, description="Goodput SLO: TTFT at most this.")
    slo_tpot_ms: float | None = Field(None, gt=0, description="Goodput SLO: TPOT at most this.")
    cost_per_hour_usd: float | None = Field(None, ge=0, description="Hardware price, for $ per 1k requests.")
    matrix: tuple[CellSpec, ...] = Field(
        (), description="Further cells: prompt x output length x concurrency x prefix sharing.")
    admission_probe: bool = Field(
        False, description="Measure the admission knee: ramp concurrency (1, 2, 4, ... up to the predicted "
        "admission, then one past it; bisected if requests queue sooner) with a fixed request shape sized so "
        "the KV pool binds before max_num_seqs (when max_model_len allows), polling the engine's running/"
        "waiting/preemption/KV-usage gauges. Costs about four pool-filling batches per variant.")
    memory_bandwidth_gbps: float | None = Field(
        None, gt=0, description="For the decode roofline; null = measured on the host (numpy copy, "
        "one thread) on CPU. Set it on GPUs (e.g. 4800 for an H200).")

    @model_validator(mode="after")
    def _enough(self) -> WorkloadSpec:
        if self.num_requests < self.concurrency:
            raise ValueError("num_requests must be at least concurrency")
        return self
