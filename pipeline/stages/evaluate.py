"""Quality and systems measurement of one variant from a single engine start.

Starting vLLM costs 30-90 s here; measuring quality and latency by hand pays it twice.
One server per variant serves lm-eval (local-completions, loglikelihood from the
engine's echoed prompt logprobs) and then the latency workload. Quality runs first so
its requests warm nothing the latency cell measures: latency prompts are distinct text.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

from pipeline import assets, stats
from pipeline.engines import loadgen
from pipeline.engines.server import SERVED_NAME, Server
from pipeline.results import (
    CellResult,
    KVCapacity,
    Latency,
    QualityResult,
    Roofline,
    SuiteQuality,
    SystemsResult,
)
from pipeline.runstore import atomic_write_text, weight_bytes, write_json

EVALSUITES = Path(__file__).resolve().parent.parent.parent / "evalsuites"
CORRECT_METRIC = "acc_norm"  # per-item correctness: length-normalised loglikelihood argmax


def render_tasks(suites: tuple[str, ...], out_dir: Path) -> dict[str, Path]:
    """Copy each suite's lm-eval task YAML into the run, with its local data path filled in."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for suite in suites:
        text = (EVALSUITES / f"{suite}.yaml").read_text()
        data = assets.suite_data(suite)
        target = out_dir / f"qe_{suite}.yaml"
        target.write_text(text.replace("{data}", str(data)))
        paths[suite] = target
    return paths


def run_quality(server: Server, model_dir: Path, recipe, variant: str, vdir: Path,
                input_hash: str, tasks_dir: Path) -> QualityResult:
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    q = recipe.quality
    render_tasks(q.suites, tasks_dir)
    tm = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    model_args = dict(model=SERVED_NAME, base_url=server.base_url + "/v1/completions",
                      tokenizer=str(model_dir), tokenizer_backend="huggingface",
                      tokenized_requests=True, num_concurrent=q.num_concurrent, batch_size=q.batch_size,
                      max_retries=2,
                      max_length=recipe.engine.max_model_len, timeout=600)
    out = lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=[f"qe_{s}" for s in q.suites],
        task_manager=tm, limit=q.limit, log_samples=True, random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0)
    suites = {}
    samples_dir = vdir / "samples"
    samples_dir.mkdir(parents=True, exist_ok=True)
    for suite in q.suites:
        rows = []
        for s in out["samples"][f"qe_{suite}"]:
            doc = s["doc"]
            lls = [float(r[0]) for r in s["filtered_resps"]]
            correct = int(float(s[CORRECT_METRIC]) == 1.0)
            rows.append({"doc_id": int(s["doc_id"]), "id": doc["id"], "question": doc["question"],
                         "choices": doc["choices"], "label": doc["label"],
                         "pred": _argmax_norm(lls, doc["choices"]), "loglikelihoods": lls,
                         "correct": correct, "acc": int(float(s["acc"]) == 1.0),
                         "doc_hash": s.get("doc_hash"), "prompt_hash": s.get("prompt_hash")})
        rows.sort(key=lambda r: r["doc_id"])
        path = samples_dir / f"{suite}.jsonl"
        text = "".join(json.dumps(r) + "\n" for r in rows)
        atomic_write_text(path, text)
        k, n = sum(r["correct"] for r in rows), len(rows)
        lo, hi = stats.wilson(k, n)
        chance = assets.SUITE_SOURCES[suite][2]
        suites[suite] = SuiteQuality(suite=suite, n=n, correct=k, accuracy=k / n if n else math.nan,
                                     ci_low=lo, ci_high=hi, chance=chance,
                                     near_chance=lo <= chance, metric=CORRECT_METRIC,
                                     samples_file=str(path.relative_to(vdir)),
                                     samples_sha256=hashlib.sha256(text.encode()).hexdigest())
    return QualityResult(variant=variant, input_hash=input_hash, status="ok",
                         duration_s=time.perf_counter() - t0, suites=suites,
                         lm_eval_version=lm_eval.__version__,
                         settings={"backend": "local-completions (vLLM server, echo+logprobs)",
                                   "limit": q.limit, "num_fewshot": 0,
                                   "correct_metric": CORRECT_METRIC})


def _argmax_norm(lls: list[float], choices: list[str]) -> int:
    """lm-eval's acc_norm choice (api/task.py): loglikelihood / len(choice) in characters."""
    normed = [ll / max(1, len(c)) for ll, c in zip(lls, choices, strict=True)]
    return max(range(len(normed)), key=normed.__getitem__)


class PromptStream:
    """Exact-length token-id prompts cut in order from packaged real prose, never reused, so
    every measured request of every cell is distinct (the prefix cache stays cold)."""

    def __init__(self, tokenizer):
        with open(assets.calibration_text("xsum")) as f:
            self._docs = iter([json.loads(line)["text"] for line in f])
        self._tok, self._ids = tokenizer, []

    def take(self, count: int, length: int, shared_prefix: bool = False) -> list[list[int]]:
        out = []
        while len(out) < count:
            while len(self._ids) < length:
                doc = next(self._docs, None)
                if doc is None:
                    raise ValueError(f"the packaged prose ran out of distinct {length}-token prompts "
                                     "(lower workload.num_requests, repeats or prompt lengths)")
                self._ids.extend(self._tok(doc + "\n\n", add_special_tokens=False)["input_ids"])
            out.append(self._ids[:length])
            self._ids = self._ids[length:]
        if shared_prefix and out:  # every prompt starts with the same first half
            head = out[0][:length // 2]
            out = [head + p[len(head):] for p in out]
        return out


def latency_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    return PromptStream(tokenizer).take(count, length)


def kv_capacity(cache: dict, model_dir: Path, engine, kv_bytes_per_elem: int, workload) -> KVCapacity:
    cfg = json.loads((model_dir / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    layers = text_cfg["num_hidden_layers"]
    kv_heads = text_cfg.get("num_key_value_heads", text_cfg["num_attention_heads"])
    head_dim = text_cfg.get("head_dim") or text_cfg["hidden_size"] // text_cfg["num_attention_heads"]
    per_token = 2 * layers * kv_heads * head_dim * kv_bytes_per_elem
    block = int(cache.get("block_size") or 0) or None
    blocks = int(cache["num_gpu_blocks"]) if cache.get("num_gpu_blocks") not in (None, "None") else None
    pool = int(engine.kv_cache_gib * 2**30)
    tokens_cfg = None
    if block:
        tokens_cfg = (pool // per_token) // block * block
    seq_len = workload.prompt_tokens + workload.output_tokens
    tokens = blocks * block if blocks and block else None
    admission = kv_only = None
    if blocks and block:
        kv_only = blocks // math.ceil(seq_len / block)
        admission = min(kv_only, engine.max_num_seqs)
    mc = cache.get("kv_cache_max_concurrency")
    return KVCapacity(block_size=block, num_blocks=blocks, tokens=tokens,
                      max_concurrency=float(mc) if mc not in (None, "None") else None,
                      bytes_per_token_config=per_token, pool_bytes_config=pool,
                      tokens_config=tokens_cfg, admission_sequences=admission, admission_kv_only=kv_only)


def run_systems(server: Server, model_dir: Path, recipe, variant: str, input_hash: str,
                kv_bytes_per_elem: int, act_bytes: int) -> SystemsResult:
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    w = recipe.workload
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=recipe.model.trust_remote_code)
    stream = PromptStream(tok)
    warm = stream.take(w.warmup_requests, w.prompt_tokens)
    if warm:
        loadgen.run_closed_loop(server.port, SERVED_NAME, warm, w.output_tokens,
                                min(w.concurrency, len(warm)), w.request_timeout_s)
    latency = measure_cell(server, stream, w, w.prompt_tokens, w.output_tokens, w.concurrency, "unique")
    cells = [CellResult(cell=c.model_dump(), latency=Latency(**measure_cell(
        server, stream, w, c.prompt_tokens, c.output_tokens, c.concurrency, c.prefix))) for c in w.matrix]
    cache = server.cache_config()
    kv = kv_capacity(cache, model_dir, recipe.engine, kv_bytes_per_elem, w)
    error = None
    if server.proc.poll() is not None:
        error = f"engine exited (code {server.proc.returncode}) during the workload"
    elif latency["completed"] == 0:
        error = f"no request completed ({latency['failed']} failed, {latency['timed_out']} timed out)"
    return SystemsResult(
        variant=variant, input_hash=input_hash, status="failed" if error else "ok", error=error,
        duration_s=time.perf_counter() - t0,
        checkpoint_bytes=weight_bytes(model_dir), engine_start_s=server.start_s, kv=kv,
        workload={**w.model_dump(), "prefix_cache": "enabled; primary cell: prompts distinct (cold); "
                  "'shared' matrix cells: same first half (warm after the first request)"},
        latency=Latency(**latency), cells=cells,
        roofline=roofline(loaded_weight_bytes(model_dir, act_bytes), kv, w, latency["tpot_ms"]["p50"]))


def loaded_weight_bytes(model_dir: Path, engine_elem_bytes: int) -> int:
    """Weight bytes the engine reads per step. A dense checkpoint is upcast on load when the
    engine computes in a wider dtype (bf16 file, float32 engine: twice the bytes); a quantized
    checkpoint is read as stored (its few unquantized tensors are ignored: approximate)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    stored = {"float32": 4, "bfloat16": 2, "float16": 2}.get(cfg.get("dtype") or cfg.get("torch_dtype"), 2)
    factor = 1.0 if "quantization_config" in cfg else engine_elem_bytes / stored
    return int(weight_bytes(model_dir) * factor)


def measure_cell(server: Server, stream: PromptStream, w, prompt_tokens: int, output_tokens: int,
                 concurrency: int, prefix: str) -> dict:
    """One cell, `w.repeats` times on fresh prompts; the summary of all its requests."""
    records, wall, repeat_p50 = [], 0.0, []
    for _ in range(w.repeats):
        batch = stream.take(w.num_requests, prompt_tokens, shared_prefix=prefix == "shared")
        recs, secs = loadgen.run_closed_loop(server.port, SERVED_NAME, batch, output_tokens, concurrency,
                                             w.request_timeout_s)
        records += recs
        wall += secs
        p50 = stats.percentiles([r.tpot * 1000 for r in recs if r.tpot is not None])["p50"]
        if p50 is not None:
            repeat_p50.append(p50)
    latency = loadgen.summarize(records, wall, w.slo_ttft_ms, w.slo_tpot_ms, w.cost_per_hour_usd)
    latency["repeats_tpot_p50_ms"] = repeat_p50
    if len(repeat_p50) > 1:
        latency["tpot_p50_spread"] = (max(repeat_p50) - min(repeat_p50)) / stats.percentiles(repeat_p50)["p50"]
    return latency


def roofline(weights: int, kv: KVCapacity, w, tpot_p50_ms: float | None) -> Roofline | None:
    """Decode is bandwidth bound: each step reads every weight once (as loaded) plus the batch's
    KV cache. Floor TPOT = bytes per step / bandwidth. Approximate: ignores activations, caches."""
    if not kv.bytes_per_token_config:
        return None
    if w.memory_bandwidth_gbps:
        bw, src = w.memory_bandwidth_gbps, "recipe (workload.memory_bandwidth_gbps)"
    else:
        bw, src = measure_bandwidth_gbps(), "measured here: numpy copy of 256 MiB, one thread, best of 5"
    mean_ctx = w.prompt_tokens + w.output_tokens / 2  # average context over the decode phase
    step = int(weights + w.concurrency * mean_ctx * kv.bytes_per_token_config)
    floor_ms = step / (bw * 1e9) * 1000
    return Roofline(bandwidth_gbps=bw, bandwidth_source=src, bytes_per_step=step, floor_tpot_ms=floor_ms,
                    measured_over_floor=tpot_p50_ms / floor_ms if tpot_p50_ms else None)


def measure_bandwidth_gbps(mib: int = 256, tries: int = 5) -> float:
    """Host memory bandwidth a single thread sees (read + write of a large copy)."""
    import numpy as np

    src = np.ones(mib * 2**20 // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def evaluate(model_dir: Path, recipe, variant: str, vdir: Path, dtype: str,
             need_quality: str | None, need_systems: str | None, tasks_dir: Path,
             log=print, extra_args: list[str] | None = None) -> tuple[QualityResult | None, SystemsResult | None]:
    """Start one engine; run whichever of quality/systems are missing (their input hashes)."""
    quality = systems = None
    extra_args = list(extra_args or [])
    act_bytes = 4 if dtype == "float32" else 2
    kv_bytes = 1 if "fp8" in extra_args else act_bytes  # --kv-cache-dtype fp8
    with Server(model_dir, recipe.engine, dtype, vdir / "engine.log",
                recipe.model.trust_remote_code, extra_args) as server:
        log(f"engine ready in {server.start_s:.0f} s (port {server.port})")
        if need_quality:
            quality = run_quality(server, model_dir, recipe, variant, vdir, need_quality, tasks_dir)
            write_json(vdir / "quality.json", quality)
            log("quality: " + ", ".join(f"{s} {r.accuracy:.3f} (n={r.n})"
                                        for s, r in quality.suites.items()))
        if need_systems:
            systems = run_systems(server, model_dir, recipe, variant, need_systems, kv_bytes, act_bytes)
        server.stop()
        if systems is not None:
            systems.peak_memory_bytes = server.memory.peak_tree_rss
            write_json(vdir / "systems.json", systems)
            lat = systems.latency
            log(f"systems: TTFT p50 {lat.ttft_ms.p50:.0f} ms, TPOT p50 {lat.tpot_ms.p50:.1f} ms, "
                f"KV {systems.kv.tokens} tokens, peak {systems.peak_memory_bytes / 2**30:.2f} GiB"
                if lat.completed else f"systems: all {lat.failed + lat.timed_out} requests failed")
    return quality, systems
