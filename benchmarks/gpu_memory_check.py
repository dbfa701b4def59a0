"""On a machine with an NVIDIA GPU: does the engines' memory sampler attribute device memory right?

    PYTHONPATH=. python3 benchmarks/gpu_memory_check.py [GIB ...]     (default: 1 4)

Starts a process tree shaped like an engine's (a guard process whose child allocates N GiB on the
GPU, touches it and holds it), samples the tree with pipeline/engines/memory.MemorySampler exactly as
a run samples its engines, and prints, per size: the device peak the sampler saw, how it attributed it
(per process from nvidia-smi's compute apps, or the whole device minus what was in use before),
and what the child's own torch said it had allocated and reserved. Needs torch with CUDA and psutil;
no vLLM. Exit 1 if a peak is not the allocation plus at most the CUDA context (1.5 GiB).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from pipeline.engines.memory import PER_PROCESS, WHOLE_DEVICE, MemorySampler, device_used_bytes

CHILD = """
import json, sys, time, torch
n = int(float(sys.argv[1]) * 2**30)
x = torch.empty(n, dtype=torch.uint8, device="cuda"); x.fill_(1); torch.cuda.synchronize()
print(json.dumps({"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}), flush=True)
time.sleep(6)
"""
GUARD = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]]).returncode)"


def one(gib: float) -> dict:
    before = device_used_bytes()
    guard = subprocess.Popen([sys.executable, "-c", GUARD, CHILD, str(gib)], stdout=subprocess.PIPE, text=True)
    sampler = MemorySampler(guard.pid, device_before=before, _gpu=True).start()
    child = json.loads(guard.stdout.readline())
    guard.wait(timeout=120)
    time.sleep(0.3)
    sampler.stop()
    peak = sampler.peak_device
    ok = sampler.device_source in (PER_PROCESS, WHOLE_DEVICE) and child["reserved"] <= peak <= child["reserved"] + 1.5 * 2**30
    return {"gib": gib, "device_before": before, "peak_device": peak, "source": sampler.device_source,
            "torch_allocated": child["allocated"], "torch_reserved": child["reserved"],
            "context_and_rest": peak - child["reserved"], "host_peak_rss": sampler.peak_tree_rss,
            "host_peak_hwm": sampler.peak_tree_hwm, "ok": ok}


def main() -> int:
    sizes = [float(a) for a in sys.argv[1:]] or [1.0, 4.0]
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    print("gpu:", smi.stdout.strip())
    rows = [one(g) for g in sizes]
    for r in rows:
        print(json.dumps(r))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
