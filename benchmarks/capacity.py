"""Capacity under one memory budget: what W8A8 (and an FP8 KV cache) free, as KV tokens and requests.

    python3 benchmarks/capacity.py [RUN_DIR]      (default: run recipes/capacity.yaml now, then read it)
    python3 benchmarks/capacity.py --reserve N    (measure the runtime reserve N times: its median and spread)

Prints, per variant, the pool plan (budget, weights predicted / as the engine loaded them, the run's
one reserve, the pool), KV tokens by the arithmetic and as the engine reported them, requests of the
workload's shape by the arithmetic and the measured admission knee, and the checks of the issue:
predicted vs engine KV pool within one block, and the W8A8 / baseline token ratio against
(budget - weights_variant - reserve) / (budget - weights_baseline - reserve).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


def run_recipe() -> Path:
    before = set((ROOT / "runs").glob("capacity-*"))
    proc = subprocess.run([str(ROOT / "quantize-eval"), "recipes/capacity.yaml", "--fresh", "--quiet"], cwd=ROOT)
    if proc.returncode not in (0, 1, 4):
        sys.exit(f"the run failed (exit {proc.returncode})")
    return sorted(set((ROOT / "runs").glob("capacity-*")) - before)[-1]


def reserve_spread(n: int) -> None:
    """The reserve is a measurement: how much it moves between probe engines sets how much a pool can."""
    import statistics
    import tempfile

    sys.path.insert(0, str(ROOT))
    from pipeline.recipe.schema import load
    from pipeline.run import runner
    from pipeline.setup import envs
    from pipeline.stages import reserve

    python = str(envs.ensure("engine"))
    if sys.executable != python:  # the probe runs vLLM: re-run this under the engine environment
        sys.exit(subprocess.run([python, __file__, "--reserve", str(n)],
                                env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode)
    r = load(ROOT / "recipes" / "capacity.yaml")
    runner.prepare_environment()
    ctx = runner.context(r, Path(tempfile.mkdtemp()))
    got = []
    for i in range(n):
        d = reserve.measure(r, ctx.model_dir, ctx.dtype, Path(tempfile.mkdtemp()) / "engine.log")
        got.append(d["reserve_bytes"] / GIB)
        print(f"reserve {i + 1}: {got[-1]:.3f} GiB (peak {d['peak_bytes'] / GIB:.3f}, weights "
              f"{d['weights_bytes'] / GIB:.3f}, pool {d['pool_bytes'] / GIB:.3f})", flush=True)
    print(f"reserve over {n}: median {statistics.median(got):.3f} GiB, spread {max(got) - min(got):.3f} GiB")


def main() -> None:
    if sys.argv[1:2] == ["--reserve"]:
        reserve_spread(int(sys.argv[2]))
        return
    run = Path(sys.argv[1]) if len(sys.argv) > 1 else run_recipe()
    data = json.loads((run / "results.json").read_text())
    print(f"run: {run}\nhost: {data['manifest'].get('hardware', {}).get('cpu', '?')}")
    rows = {}
    for name, r in data["variants"].items():
        s = r.get("systems") or {}
        kv = s.get("kv") or {}
        p = kv.get("plan")
        if not p:
            print(f"{name:>18}: no pool plan ({s.get('error') or r.get('error') or 'not evaluated'})")
            continue
        rows[name] = (p, kv)
        probe = kv.get("probe") or {}
        tag = " PROJECTED" if p["projected"] else ""
        print(f"{name:>18}:{tag} budget {p['budget_bytes'] / GIB:.2f} GiB, weights {p['weights_bytes'] / 2**20:.1f} MiB "
              f"predicted / {(p['engine_weights_bytes'] or 0) / 2**20:.1f} MiB engine, reserve "
              f"{p['reserve_bytes'] / GIB:.3f} GiB, pool {p['pool_bytes'] / 2**20:.1f} MiB; KV tokens {p['tokens']} "
              f"arithmetic / {kv.get('tokens')} engine; requests @shape {p['admitted']} arithmetic / "
              f"knee {probe.get('knee')} measured; peak {(p['peak_bytes'] or 0) / GIB:.2f} GiB")
    if "baseline" not in rows:
        return
    b, bkv = rows["baseline"]
    for name, (p, kv) in rows.items():
        if name == "baseline" or p["projected"] or not kv.get("tokens"):
            continue
        block = kv["block_size"]
        pools = (p["budget_bytes"] - p["weights_bytes"] - p["reserve_bytes"]) / (
            b["budget_bytes"] - b["weights_bytes"] - b["reserve_bytes"])
        expected_tokens = p["pool_bytes"] / kv["bytes_per_token_config"]  # the pool over its bytes per token
        within = abs(kv["tokens"] - expected_tokens) <= block
        knee_b, knee_v = (bkv.get("probe") or {}).get("knee"), (kv.get("probe") or {}).get("knee")
        print(f"{name:>18}: pool x{pools:.3f} = (B-Wv-R)/(B-Wb-R); KV tokens x{kv['tokens'] / bkv['tokens']:.3f} "
              f"(per-token bytes x{bkv['bytes_per_token_config'] / kv['bytes_per_token_config']:.0f}); engine tokens "
              f"{kv['tokens']} vs pool / bytes per token {expected_tokens:.0f}: "
              f"{'within one block' if within else 'NOT within one block'}; predicted - engine "
              f"{p['tokens'] - kv['tokens']:+d} tokens; knee {knee_v} vs baseline {knee_b}"
              + (f" (x{knee_v / knee_b:.2f})" if knee_b and knee_v else ""))

if __name__ == "__main__":
    main()
