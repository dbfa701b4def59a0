"""Typed, versioned results: what each stage writes and the report and sign-off read.

Every file carries `schema_version`, the `input_hash` of what produced it, `status`,
`duration_s` and `error`. A stage is finished when its file validates and its input hash
matches the current inputs (pipeline/runstore.py decides that).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["ok", "failed", "skipped"]


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StageResult(Model):
    schema_version: Literal[1] = 1
    variant: str
    input_hash: str
    status: Status
    duration_s: float
    error: str | None = None


class QuantizeResult(StageResult):
    stage: Literal["quantize"] = "quantize"
    scheme: str
    checkpoint_dir: str | None = None
    checkpoint_bytes: int | None = None
    cache_key: str | None = None
    cached: bool = False
    peak_rss_bytes: int | None = None
    quantize_wall_s: float | None = None
    llmcompressor_recipe: str | None = None
    ignored_modules: list[str] = Field(default_factory=list)
    facts: dict = Field(default_factory=dict, description="bits_per_weight in effect, base_parameters, "
                        "unquantized_modules (2-D weights left in floating point), tensor_dtypes")
    warnings: list[str] = Field(default_factory=list)
    versions: dict[str, str] = Field(default_factory=dict)


class SliceStat(Model):
    n: int
    correct: int
    accuracy: float
    ci_low: float
    ci_high: float
    chance: float


class SuiteQuality(Model):
    suite: str
    n: int
    correct: int
    accuracy: float
    ci_low: float
    ci_high: float
    chance: float = Field(description="Mean chance accuracy of the items (1 / choices; 0 for generation).")
    near_chance: bool = Field(description="The CI reaches chance: on the baseline, this suite cannot show damage.")
    metric: str = "acc"
    kind: str = Field("mc", description="mc (loglikelihood of choices), gen (generation), user (your task).")
    # counted in overall accuracy and in each_suite gates; a safety suite's "correct" is a refusal, not an
    # answer, so it is judged by its own gates (refusal_rate_delta, harmful_compliance_flips) only
    pooled: bool = True
    categories: dict[str, int] = Field(default_factory=dict, description="Items per failure category.")
    slices: dict[str, SliceStat] = Field(default_factory=dict, description="'dimension=value' -> accuracy.")
    samples_file: str
    samples_sha256: str | None = None


class DriftQuality(Model):
    windows: int
    tokens: int
    window_tokens: int
    top_k: int
    perplexity: float
    corpus: str
    code_windows: int = 0  # windows of the second text domain (code), in the samples beside the essays'
    samples_file: str
    samples_sha256: str | None = None


class NoiseFloor(Model):
    """The baseline's items scored twice in one engine, batched differently: the flips the engine makes
    against itself (A/A). Symmetric noise: it widens a paired CI (which holds it already), never biases it."""
    n: int
    flips_correct_to_wrong: int
    flips_wrong_to_correct: int
    how: str
    identical: bool | None = Field(None, description="Every item scored again came back with the first pass's "
                                   "numbers bit for bit (log-likelihoods, or generated text).")

    @property
    def flips(self) -> int:
        return self.flips_correct_to_wrong + self.flips_wrong_to_correct


class SuiteAgreement(Model):
    """One suite's sampled items scored by both engines, compared item by item."""
    n: int
    same_answer: int = Field(description="Items whose chosen answer (multiple choice) or generated text agree.")
    max_rel_diff: float | None = Field(None, description="Largest |LL_engine - LL_reference| / max(1, |LL_engine|) "
                                       "over every choice of every item (multiple choice only).")
    median_rel_diff: float | None = None
    worst_doc_id: int | None = None


class AgreementResult(StageResult):
    """A sample of every suite's items scored again by the reference engine (pipeline/engines/transformers),
    loading the checkpoint the variant was built as, and compared with what the serving engine answered."""
    stage: Literal["agreement"] = "agreement"
    reference: str = ""
    loaded: str = Field("", description="What the reference engine loaded.")
    dtype: str = ""
    sample: int = 0
    tolerance_rel: float | None = Field(None, description="The largest relative log-likelihood difference the "
                                        "engine dtype explains; above it the engines disagree.")
    suites: dict[str, SuiteAgreement] = Field(default_factory=dict)
    flagged: bool = False
    reason: str = ""


class QualityResult(StageResult):
    stage: Literal["quality"] = "quality"
    suites: dict[str, SuiteQuality] = Field(default_factory=dict)
    noise_floor: dict[str, NoiseFloor] = Field(default_factory=dict, description="Baseline only: per suite, A/A.")
    drift: DriftQuality | None = None
    lm_eval_version: str | None = None
    settings: dict = Field(default_factory=dict)

    def overall(self) -> tuple[int, int]:
        """(correct, n) over every scored item of every suite but a safety suite's refusals: the one definition
        of overall accuracy that sign-off, the report and `compare` read."""
        pooled = [s for s in self.suites.values() if s.pooled]
        return sum(s.correct for s in pooled), sum(s.n for s in pooled)

    def overall_accuracy(self) -> float | None:
        k, n = self.overall()
        return k / n if n else None


class Percentiles(Model):
    p50: float | None
    p95: float | None
    p99: float | None


class RampStep(Model):
    """One step of the admission ramp: `concurrency` requests of the probe shape sent at once."""

    concurrency: int
    max_running: int = Field(description="Most sequences the engine ran at once (the engine's 'running' gauge, "
                             "polled every 10-50 ms and when the last request had its first token).")
    max_streaming: int | None = Field(None, description="Most of the step's requests the client saw streaming at "
                                      "once (first token in, last not yet): a lower bound on the running count "
                                      "that no poll can miss.")
    max_waiting: int = Field(description="Most requests waiting at once (the engine's 'waiting' gauge); also "
                             "non-zero below the knee while the token budget staggers long prompts.")
    preemptions: int = Field(description="Sequences preempted during the step (the 'preemptions' gauge).")
    kv_usage_peak: float | None = Field(None, description="Peak of the engine's 'kv_usage' gauge (0-1).")
    queued: bool = Field(description="A request waited while the pool had no room to admit one more (or "
                         "max_num_seqs were running), or a sequence was preempted: past the knee.")
    overlapped: bool = Field(True, description="All the step's requests were seen running together (by the "
                             "gauge or streaming at the client); a step that neither queued nor overlapped did "
                             "not test admission.")
    ttft_p50_ms: float | None = None
    ttft_max_ms: float | None = Field(None, description="Past the knee: includes the queued requests' wait.")
    tpot_p50_ms: float | None = None
    e2e_p50_ms: float | None = None
    completed: int
    failed: int
    duration_s: float | None = Field(None, description="Wall time of the step.")
    errors: list[str] = Field(default_factory=list, description="Distinct errors of failed requests.")


class AdmissionProbe(Model):
    """The measured knee: a ramp of fixed-shape request batches (1, 2, 4, ... up to the prediction,
    then one past it; bisected when requests queue earlier), the engine's own scheduler gauges
    polled while each runs."""

    prompt_tokens: int
    output_tokens: int
    blocks_per_sequence: int
    predicted: int = Field(description="min((KV blocks - 1 null block) // blocks per sequence, max_num_seqs).")
    binding: str = Field(description="kv or max_num_seqs: which limit the prediction says binds first.")
    steps: list[RampStep] = Field(description="Every step of the ramp, by concurrency.")
    knee: int = Field(description="Most concurrent requests that all ran at once without queueing or preemption.")
    first_queued: int | None = Field(None, description="Fewest concurrent requests that queued (knee + 1 when "
                                     "the ramp found it); None if no step queued.")
    requests: int = Field(description="Requests sent over the whole ramp.")
    max_running: int = Field(description="Most sequences the engine ran at once over the ramp.")
    preemptions: int = Field(description="Sequences preempted over the whole ramp.")
    kv_usage_peak: float | None = Field(None, description="Peak of the engine's 'kv_usage' gauge (0-1) over the ramp.")
    empirical_tokens: int | None = Field(
        None, description="KV tokens that can hold sequences, measured at the knee step: blocks in use (knee x "
        "blocks per sequence) / the engine's peak usage gauge x block size; KV-bound probes without preemption.")
    completed: int
    note: str = ""


class BudgetPlan(Model):
    """How one engine's KV pool was sized (pipeline/measure/membudget.py) and what the engine then did with it."""

    mode: Literal["budget", "gpu", "fixed"] = Field(
        description="budget: the engine sized its own pool so its process tree keeps within the budget (CPU); "
        "gpu: vLLM sized the pool within gpu_memory_utilization; fixed: engine.kv_cache_gib for every variant.")
    projected: bool = Field(False, description="No engine ran these weights natively here: capacity is "
                            "projected from the weights the checkpoint would load as, never measured.")
    budget_bytes: int | None = None
    budget_source: str = ""
    weights_bytes: int = Field(description="Weights as loaded per tensor-parallel rank, predicted from the safetensors "
                               "headers (engine dtype for floating-point tensors, quantized tensors as stored).")
    engine_weights_bytes: int | None = Field(None, description="Parameters the engine reported it loaded.")
    outside_bytes: int | None = Field(None, description="Kept aside from the budget for what the engine's own sizing "
                                      "does not count (API server, helpers, the worker's transient): one figure for "
                                      "every engine of the run (measure/overhead.py).")
    runtime_bytes: int | None = Field(None, description="The worker's memory besides weights and pool, as predicted "
                                      "before the engine ran (this host's measurement, else a prior).")
    overhead_source: str = ""
    predicted_pool_bytes: int | None = Field(None, description="(budget - outside) / tp - weights - runtime: each "
                                             "rank's pool predicted before the engine sized its own (budget and "
                                             "outside are the whole tree's; weights, runtime and pool per rank).")
    predicted_tokens: int | None = Field(None, description="KV tokens of the predicted pool (whole blocks): what a "
                                         "projected variant is compared with.")
    predicted_admitted: int | None = Field(None, description="Requests of the workload's shape the predicted pool holds.")
    sizing: dict | None = Field(None, description="What the engine was asked and decided (fraction, the node memory "
                                "it read, its request, its non-KV memory: engines/vllm/sizing.py).")
    reserve_bytes: int | None = Field(None, description="Runs before engine sizing: the measured runtime reserve.")
    reserve_source: str = ""
    pool_bytes: int | None = Field(None, description="KV pool the engine was given (fixed) or chose (budget, gpu), "
                                   "per tensor-parallel rank; the prediction until the engine ran, and for a "
                                   "projected plan.")
    kv_bytes_per_block: int
    block_size: int
    tokens: int | None = Field(None, description="KV tokens the pool holds by the arithmetic (whole blocks).")
    admitted: int | None = Field(None, description="Requests of the workload's prompt+output shape the pool holds "
                                 "at once by the arithmetic (the KV bound, before max_num_seqs).")
    engine_tokens: int | None = Field(None, description="KV tokens the engine reported.")
    peak_bytes: int | None = Field(None, description="Peak memory of the engine's process tree, beside the budget.")
    tolerance_bytes: int | None = Field(None, description="How far over the budget a peak may go before the variant's "
                                        "capacity is marked over budget (membudget.tolerance).")
    across: list[dict] | None = Field(None, description="Capacity over budgets around the run's (membudget.across_budgets): "
                                      "budget_bytes, pool_bytes, tokens, requests (the KV bound at the workload's shape), "
                                      "measured (the engine's own pool) or not (arithmetic on this engine's measured "
                                      "non-KV memory).")

    @property
    def loaded_bytes(self) -> int | None:
        """Memory as loaded: the weights the engine holds plus its KV pool."""
        return self.weights_bytes + self.pool_bytes if self.pool_bytes is not None else None

    @property
    def over_budget_bytes(self) -> int | None:
        """By how much the engine's peak exceeded its budget beyond the tolerance; None when it kept it
        (or nothing says)."""
        if self.peak_bytes is None or self.budget_bytes is None or self.mode != "budget":
            return None
        over = self.peak_bytes - self.budget_bytes
        return over if over > (self.tolerance_bytes or 0) else None


class KVCapacity(Model):
    block_size: int | None
    num_blocks: int | None
    null_blocks: int = Field(1, description="Blocks of the pool that never hold tokens (vLLM keeps one, its null block).")
    tokens: int | None = Field(description="num_blocks * block_size, from the engine.")
    max_concurrency: float | None = Field(description="Engine's own figure for max_model_len requests.")
    bytes_per_token_config: int | None = Field(
        description="2 * layers * kv_heads * head_dim * bytes per element, from the model config.")
    pool_bytes_config: int | None = None
    tokens_config: int | None = Field(None, description="Pool bytes / per-token bytes, whole blocks.")
    admission_sequences: int | None = Field(
        None, description="Sequences of the workload's prompt+output length admitted at once: "
        "min((KV blocks - 1 null block) // blocks per sequence, max_num_seqs).")
    admission_kv_only: int | None = Field(None, description="The KV-pool bound alone.")
    probe: AdmissionProbe | None = Field(None, description="The measured admission knee, if the recipe asks.")
    plan: BudgetPlan | None = Field(None, description="How the pool was sized: budget, gpu or fixed.")


class Latency(Model):
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    completed: int
    failed: int
    timed_out: int
    output_tokens: int
    duration_s: float
    output_tok_per_s: float
    request_per_s: float
    goodput_req_per_s: float | None = Field(None, description="Completed requests meeting the SLO / s.")
    slo_attainment: float | None = Field(None, description="Fraction of requests meeting the SLO.")
    cost_per_1k_requests_usd: float | None = None
    repeats_tpot_p50_ms: list[float] = Field(default_factory=list,
                                             description="p50 TPOT of each repeat of the cell.")
    repeats: list[dict] = Field(default_factory=list, description="Each repeat's own ttft/tpot p50 and p99 (ms): "
                                "latency gates take their interval from these.")
    tpot_p50_spread: float | None = Field(None, description="(max - min) / median of repeats_tpot_p50_ms.")


class CellResult(Model):
    cell: dict = Field(description="prompt_tokens, output_tokens, concurrency, prefix.")
    latency: Latency
    admission_sequences: int | None = Field(
        None, description="Sequences of this cell's prompt+output length the KV pool admits at once, "
        "capped by max_num_seqs.")


class Roofline(Model):
    bandwidth_gbps: float
    bandwidth_source: str
    bytes_per_step: int = Field(description="Weight bytes + KV bytes of the batch read per decode step.")
    weight_bytes: int | None = None
    weight_bytes_source: str = ""
    floor_tpot_ms: float
    measured_over_floor: float | None


class SystemsResult(StageResult):
    stage: Literal["systems"] = "systems"
    host: str | None = Field(None, description="The machine it was measured on: ratios between results of "
                             "different hosts are not like for like.")
    checkpoint_bytes: int | None = None
    peak_memory_bytes: int | None = Field(None, description="Peak RSS summed over the engine tree, sampled.")
    peak_memory_hwm_bytes: int | None = Field(
        None, description="Sum over the engine tree of each process's kernel high-water mark (VmHWM) while it "
        "loaded and served (the quality stage's prompt scoring, an evaluation artifact, is measured apart): "
        "catches spikes the sampling misses; what the memory budget is checked against.")
    weight_memory_bytes: int | None = Field(
        None, description="Parameters + buffers the engine holds once its weights are loaded (engine dtype, "
        "quantized tensors as stored), reported from inside the engine; None if it did not report.")
    weight_memory: dict = Field(default_factory=dict, description="parameters, buffers, per device, and "
                                "the same after kernel post-processing (CPU packs weights into opaque handles).")
    device_memory_peak_bytes: int | None = Field(
        None, description="GPU only: peak device memory of the engine's processes (nvidia-smi).")
    device_memory_source: str | None = Field(
        None, description="How the device memory was attributed: per process, or the whole GPU (approximate).")
    engine_start_s: float | None = None
    engine_launch: str | None = Field(
        None, description="How that engine started, which its start time depends on: cold (a new interpreter), "
        "warm (forked from a process with vLLM imported), or warm after waiting for that process's import.")
    kv: KVCapacity | None = None
    workload: dict = Field(default_factory=dict)
    latency: Latency | None = None
    roofline: Roofline | None = None
    cells: list[CellResult] = Field(default_factory=list, description="The workload matrix, if any.")
    timers: str = (
        "TTFT: request sent -> first streamed token received; TPOT: (e2e - TTFT) / (tokens - 1); "
        "ITL: gaps between streamed chunks; e2e: request sent -> last byte. Client-side, "
        "127.0.0.1, warm-up requests excluded."
    )


class Measured(Model):
    value: float | None
    caveat: str = Field("", description="Why the value may not mean what it says (e.g. measured on two hosts).")
    ci_low: float | None = None
    ci_high: float | None = None
    interval: Literal["ci95", "repeats"] = Field(
        "ci95", description="ci95: a 95% confidence interval over items (or windows); repeats: a 95% t interval "
        "over the cell's repeats, each side measured in one engine start (start-to-start spread is not in it). "
        "Both are judged alike: PASS when the conservative end clears the threshold, FAIL when the point "
        "estimate is beyond it, INCONCLUSIVE in between.")
    n: int | None = Field(None, description="How many units the interval rests on (n_of names them).")
    n_of: str = Field("items", description="What n counts: items, windows, workload.repeats or workload.engine_starts.")


class GateOutcome(Model):
    metric: str
    scope: str
    op: str
    threshold: float
    severity: Literal["fail", "warn"]
    judged_on: str
    measured: Measured
    outcome: Literal["PASS", "WARN", "FAIL", "N/A", "ERROR", "INCONCLUSIVE"]
    note: str = ""


class PairedDrift(Model):
    tokens: int
    windows: int
    documents: int | None = Field(None, description="Essays (or code files) the windows come from: the units "
                                  "the intervals resample.")
    top_k: int
    kl_mean: float = Field(description="Mean KL(baseline || variant) per token, nats; a lower bound (top-k partition).")
    kl_ci_low: float
    kl_ci_high: float
    kl_p99: float
    top1_agreement: float
    top1_ci_low: float
    top1_ci_high: float
    ppl_base: float
    ppl_var: float
    ppl_ratio: float
    ppl_ratio_ci_low: float
    ppl_ratio_ci_high: float


class PairedSlice(Model):
    slice: str
    suite: str = ""
    n: int
    base_acc: float
    var_acc: float
    delta: float
    delta_ci_low: float
    delta_ci_high: float
    flips_correct_to_wrong: int
    flips_wrong_to_correct: int
    mcnemar_p: float
    mcnemar_p_holm: float | None = None
    near_chance: bool


# UNVERIFIED: every gate that was measured passes, but a fail gate could not be measured on this
# hardware (the engine here has no kernel for the variant's scheme): not signed, not failed.
# INCONCLUSIVE: every gate was measured and none failed, but a fail gate's interval still straddles
# its threshold (the point passes, the conservative end does not): more items or repeats would decide.
Verdict = Literal["PASS", "WARN", "FAIL", "INCONCLUSIVE", "UNVERIFIED", "SKIPPED", "FAILED-TO-RUN"]
# what a run verdict other than PASS means, in words (the report's banner and the console's last line)
VERDICT_MEANING = {"FAIL": "a fail gate failed", "INCONCLUSIVE": "not enough data to decide a fail gate; nothing failed",
                   "UNVERIFIED": "a fail gate, or every variant, cannot be measured on this hardware",
                   "WARN": "a warn gate did not pass"}


class VariantSignoff(Model):
    variant: str
    verdict: Verdict
    reason: str = ""
    gates: list[GateOutcome] = Field(default_factory=list)
    paired: list[PairedSlice] = Field(default_factory=list)
    drift: PairedDrift | None = None
    drift_code: PairedDrift | None = Field(None, description="Drift on the second text domain (code windows).")
    data: str = Field("all", description="The quality data it was judged on: all, or a search's half of it.")


class Signoff(Model):
    schema_version: Literal[1] = 1
    recipe: str
    recipe_hash: str
    verdict: Literal["PASS", "WARN", "FAIL", "INCONCLUSIVE", "UNVERIFIED"]
    exit_code: int
    variants: list[VariantSignoff]
    recommended: str | None = None
    recommendation_rule: str = ""
