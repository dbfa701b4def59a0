"""Systems of one variant on a running engine: latency cells, memory, KV capacity, roofline.

The primary cell (the one gates read) and every cell of the workload matrix are driven at
fixed concurrency over fresh prompts (pipeline/measure/prompts.py); KV capacity is read from the
engine and computed from the config (pipeline/measure/capacity.py); the weights the engine holds are
reported from inside it (engines/vllm/hooks/sitecustomize.py) and feed the decode roofline. The
admission ramp, when the recipe asks for it, is handed in by the caller (stages/admission.py).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from pipeline.engines.interface import Engine, KVLayout
from pipeline.measure import capacity, loadgen, membudget, stats
from pipeline.measure.prompts import PromptStream
from pipeline.progress import Progress
from pipeline.results import CellResult, KVCapacity, Latency, Roofline, SystemsResult
from pipeline.runstore import weight_bytes
from pipeline.setup import modelcfg


def kv_capacity(layout: KVLayout, model_dir: Path, engine, kv_bytes_per_elem: int, workload, plan=None) -> KVCapacity:
    """KV capacity as the engine reports it (blocks x block size) beside the config arithmetic
    (pipeline/measure/capacity.py, cut as vLLM cuts the pool), and the sequences of the workload's shape it
    admits at once; `plan` is how the pool was sized (pipeline/measure/membudget.py)."""
    cfg = modelcfg.read(model_dir)
    tp = engine.tensor_parallel_size
    per_token = capacity.kv_bytes_per_token(cfg, kv_bytes_per_elem, tp)
    block, blocks = layout.block_size, layout.num_blocks
    pool = plan.pool_bytes if plan is not None and plan.pool_bytes is not None else (
        engine.fixed_pool_bytes)
    lay = capacity.layout(cfg, kv_bytes_per_elem, block=block or 16, tp=tp)
    tokens_cfg = lay.tokens(pool) if block and pool is not None else None
    seq_len = workload.prompt_tokens + workload.output_tokens
    tokens = blocks * block if blocks and block else None
    admission = kv_only = None
    if blocks and block:
        kv_only = capacity.admitted_blocks(blocks, lay.blocks_per_request(seq_len))
        admission = min(kv_only, engine.max_num_seqs)
    return KVCapacity(block_size=block, num_blocks=blocks, null_blocks=layout.null_blocks, tokens=tokens,
                      max_concurrency=layout.max_concurrency,
                      bytes_per_token_config=per_token, pool_bytes_config=pool,
                      tokens_config=tokens_cfg, admission_sequences=admission, admission_kv_only=kv_only,
                      plan=plan.model_copy() if plan is not None else None)


def verify_plan(s: SystemsResult, model_dir: Path, engine, kv_bytes_per_elem: int, seq_len: int,
                sizing: dict | None = None) -> None:
    """The pool plan beside what the engine did: the pool it chose (`sizing`: how), its KV tokens, the
    weights it loaded, its peak memory."""
    if s.kv is None or s.kv.plan is None:
        return
    cfg, tp = modelcfg.read(model_dir), engine.tensor_parallel_size
    membudget.verify(s.kv.plan, cfg, kv_bytes_per_elem, tp, s.kv.block_size, s.kv.tokens,
                     (s.weight_memory or {}).get("parameters"), s.peak_memory_hwm_bytes or s.peak_memory_bytes,
                     seq_len, sizing)
    logged = (sizing or {}).get("pool_bytes_logged")
    if logged is not None and s.kv.block_size:  # the arithmetic on the pool the engine logged it chose
        lay = capacity.layout(cfg, kv_bytes_per_elem, block=s.kv.block_size, tp=tp)
        s.kv.pool_bytes_config, s.kv.tokens_config = logged, lay.tokens(logged)
    s.kv.plan.across = membudget.across_budgets(s.kv.plan, cfg, kv_bytes_per_elem, tp, seq_len,
                                                engine.max_model_len) or None


def run_systems(server: Engine, model_dir: Path, recipe, variant: str, input_hash: str,
                kv_bytes_per_elem: int, act_bytes: int, log=print, probe=None, plan=None) -> SystemsResult:
    """Warm-up, the primary cell, the matrix cells, KV capacity, then `probe` (the admission ramp,
    stages/admission.admission_probe, when the recipe asks for it) on the same prompt stream."""
    t0 = time.perf_counter()
    w = recipe.workload
    stream = warmed_stream(server, model_dir, recipe)
    latency = measure_cell(server, stream, w, w.prompt_tokens, w.output_tokens, w.concurrency, "unique", variant)
    cells = [CellResult(cell=c.model_dump(), latency=Latency(**measure_cell(
        server, stream, w, c.prompt_tokens, c.output_tokens, c.concurrency, c.prefix, variant))) for c in w.matrix]
    kv = kv_capacity(server.kv_layout(), model_dir, recipe.engine, kv_bytes_per_elem, w, plan)
    if kv.num_blocks and kv.block_size:  # admission for every shape of the matrix, too
        for c in cells:
            c.admission_sequences = capacity.admitted(kv.num_blocks, kv.block_size,
                                                      c.cell["prompt_tokens"] + c.cell["output_tokens"],
                                                      recipe.engine.max_num_seqs)
    if probe is not None:
        try:
            kv.probe = probe(server, stream, recipe.engine, kv, w.request_timeout_s, label=variant,
                             shape=(w.prompt_tokens, w.output_tokens))
        except (OSError, ValueError) as exc:  # an optional probe must not cost the measured cells
            log(f"admission probe failed: {type(exc).__name__}: {exc}")
    error = None
    if server.proc.poll() is not None:
        error = f"engine exited (code {server.proc.returncode}) during the workload"
    elif latency["completed"] == 0:
        error = f"no request completed ({latency['failed']} failed, {latency['timed_out']} timed out)"
    loaded = server.loaded_weights()  # logged by the engine once its weights were in place
    if loaded:  # the decode floor from the bytes the engine really holds
        weights, source = loaded["parameters"], "parameters as loaded (reported by the engine)"
    else:
        weights, source = loaded_weight_bytes(model_dir, act_bytes), FROM_CHECKPOINT
    return SystemsResult(
        variant=variant, input_hash=input_hash, status="failed" if error else "ok", error=error,
        host=socket.gethostname(),
        duration_s=time.perf_counter() - t0,
        checkpoint_bytes=weight_bytes(model_dir), engine_start_s=server.start_s, kv=kv,
        engine_launch=server.launch,
        weight_memory=loaded or {},
        weight_memory_bytes=loaded["parameters"] + loaded["buffers"] if loaded else None,
        workload={**w.model_dump(), "prefix_cache": "enabled; primary cell: prompts distinct (cold); "
                  "'shared' matrix cells: same first half (warm after the first request)"},
        latency=Latency(**latency), cells=cells,
        roofline=roofline(weights, kv, w, latency["tpot_ms"]["p50"], source))


def record_memory(s: SystemsResult, memory) -> None:
    """Peak memory of the engine's process tree (and device), sampled until the engine stopped."""
    s.peak_memory_bytes = memory.peak_tree_rss
    s.peak_memory_hwm_bytes = memory.serving_peak or None
    s.device_memory_peak_bytes = memory.peak_device or None
    s.device_memory_source = memory.device_source


def summary(s: SystemsResult) -> str:
    """The stage's console line."""
    lat = s.latency
    if not lat.completed:
        return f"all {lat.failed + lat.timed_out} requests failed"
    # the peak the budget is judged on (the kernel's high-water mark of the tree), not the sampled RSS sum,
    # which counts pages a forked process shares twice
    peak = s.peak_memory_hwm_bytes or s.peak_memory_bytes
    return (f"TTFT p50 {lat.ttft_ms.p50:.0f} ms, TPOT p50 {lat.tpot_ms.p50:.1f} ms, "
            f"KV {s.kv.tokens} tokens, serving peak {peak / 2**30:.2f} GiB")


def loaded_weight_bytes(model_dir: Path, engine_elem_bytes: int) -> int:
    """Weight bytes the engine reads per step. A dense checkpoint is upcast on load when the
    engine computes in a wider dtype (bf16 file, float32 engine: twice the bytes); a quantized
    checkpoint is read as stored (its few unquantized tensors are ignored: approximate)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    stored = {"float32": 4, "bfloat16": 2, "float16": 2}.get(cfg.get("dtype") or cfg.get("torch_dtype"), 2)
    factor = 1.0 if "quantization_config" in cfg else engine_elem_bytes / stored
    return int(weight_bytes(model_dir) * factor)


def warmed_stream(server: Engine, model_dir: Path, recipe) -> PromptStream:
    """A fresh prompt stream for this engine, after the workload's warm-up requests (not measured)."""
    from transformers import AutoTokenizer

    w = recipe.workload
    stream = PromptStream(AutoTokenizer.from_pretrained(model_dir, trust_remote_code=recipe.model.trust_remote_code))
    warm = stream.take(w.warmup_requests, w.prompt_tokens)
    if warm:
        loadgen.run_closed_loop(server.port, server.served_name, warm, w.output_tokens,
                                min(w.concurrency, len(warm)), w.request_timeout_s)
    return stream


def restart_repeats(server: Engine, model_dir: Path, recipe, variant: str, start: int) -> list[dict]:
    """On a further engine start: warm-up, then the primary cell's repeats again, each tagged with the
    start it ran in (sign-off judges latency across starts from them)."""
    w = recipe.workload
    stream = warmed_stream(server, model_dir, recipe)
    one = measure_cell(server, stream, w, w.prompt_tokens, w.output_tokens, w.concurrency, "unique",
                       f"{variant} start {start + 1}/{w.engine_starts}")
    return [{**r, "start": start} for r in one["repeats"]]


def add_start(s: SystemsResult, repeats: list[dict]) -> None:
    """A further start's repeats join the primary cell's (the first start's figures stay the summary)."""
    s.latency.repeats += repeats
    s.latency.repeats_tpot_p50_ms += [r["tpot_p50"] for r in repeats if r["tpot_p50"] is not None]


def measure_cell(server: Engine, stream: PromptStream, w, prompt_tokens: int, output_tokens: int,
                 concurrency: int, prefix: str, label: str = "") -> dict:
    """One cell, `w.repeats` times on fresh prompts (one engine start, tagged 0): the summary of all its
    requests, and each repeat's own percentiles, whose spread gates judge noise against."""
    records, wall, repeats = [], 0.0, []
    what = f"latency {prompt_tokens}/{output_tokens} c={concurrency}{' shared' if prefix == 'shared' else ''}"
    with Progress(what, w.repeats * w.num_requests, "requests", label) as bar:
        for _ in range(w.repeats):
            batch = stream.take(w.num_requests, prompt_tokens, shared_prefix=prefix == "shared")
            recs, secs = loadgen.run_closed_loop(server.port, server.served_name, batch, output_tokens, concurrency,
                                                 w.request_timeout_s, on_done=bar.advance)
            records += recs
            wall += secs
            one = loadgen.summarize(recs, secs)
            repeats.append({"start": 0, **{f"{k}_{q}": one[f"{k}_ms"][q] for k in ("ttft", "tpot")
                                           for q in ("p50", "p95", "p99")}})
    latency = loadgen.summarize(records, wall, w.slo_ttft_ms, w.slo_tpot_ms, w.cost_per_hour_usd)
    p50s = [r["tpot_p50"] for r in repeats if r["tpot_p50"] is not None]
    latency["repeats"] = repeats
    latency["repeats_tpot_p50_ms"] = p50s
    if len(p50s) > 1:
        latency["tpot_p50_spread"] = (max(p50s) - min(p50s)) / stats.percentiles(p50s)["p50"]
    return latency


FROM_CHECKPOINT = "checkpoint bytes, dense ones scaled to the engine dtype"


def roofline(weights: int, kv: KVCapacity, w, tpot_p50_ms: float | None,
             weights_source: str = FROM_CHECKPOINT) -> Roofline | None:
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
                    weight_bytes=weights, weight_bytes_source=weights_source,
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
