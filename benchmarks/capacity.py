"""Capacity under one memory budget: what W8A8 (and an FP8 KV cache) free, as KV tokens and requests.

    python3 benchmarks/capacity.py [RUN_DIR]      (default: run recipes/capacity.yaml now, then read it)

Prints, per variant, the pool plan (budget, weights predicted / as the engine loaded them, what the run
keeps outside each engine's own sizing, the runtime predicted and as the engine held it, the pool
predicted and as the engine chose it), KV tokens by the arithmetic on the pool the engine logged and as
the engine reported them, requests of the workload's shape and the measured admission knee, and each
engine's peak beside the budget and its tolerance.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


def run_recipe() -> Path:
    before = set((ROOT / "runs").glob("capacity-*"))
    proc = subprocess.run([str(ROOT / "quantize-eval"), "recipes/capacity.yaml", "--fresh", "--quiet"], cwd=ROOT)
    if proc.returncode not in (0, 1, 4, 5):  # a verdict, whichever (2: bad input, 3: compare)
        sys.exit(f"the run failed (exit {proc.returncode})")
    return sorted(set((ROOT / "runs").glob("capacity-*")) - before)[-1]


def b_pred(data: dict) -> str:
    p = (((data["variants"].get("baseline") or {}).get("systems") or {}).get("kv") or {}).get("plan") or {}
    return f"{p.get('predicted_tokens')} tokens, {p.get('predicted_admitted')} requests"


def main() -> None:
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
        sz = p.get("sizing") or {}
        peak, budget, tol = p.get("peak_bytes") or 0, p["budget_bytes"], p.get("tolerance_bytes") or 0
        kept = "kept" if peak <= budget + tol else f"OVER by {(peak - budget) / 2**20:.0f} MiB"
        if p["projected"]:
            print(f"{name:>18}: PROJECTED (no engine ran it natively here): weights {p['weights_bytes'] / 2**20:.1f} MiB "
                  f"as it would load, pool {p['pool_bytes'] / 2**20:.0f} MiB, {p['tokens']} KV tokens, requests @shape "
                  f"{p['admitted']} by the arithmetic (the baseline predicted alike: {b_pred(data)})")
            continue
        print(f"{name:>18}: budget {budget / GIB:.2f} GiB, weights {p['weights_bytes'] / 2**20:.1f} MiB "
              f"predicted / {(p['engine_weights_bytes'] or 0) / 2**20:.1f} MiB engine, outside "
              f"{(p.get('outside_bytes') or 0) / GIB:.2f} GiB, worker non-KV {(sz.get('non_kv_bytes') or 0) / GIB:.2f} GiB, "
              f"pool {(p.get('predicted_pool_bytes') or 0) / 2**20:.0f} MiB predicted / {p['pool_bytes'] / 2**20:.0f} MiB "
              f"engine; KV tokens {kv.get('tokens_config')} arithmetic on the logged pool / {kv.get('tokens')} engine; "
              f"requests @shape {p['admitted']} / knee {probe.get('knee')} measured; peak {peak / GIB:.2f} GiB "
              f"({kept}, tolerance {tol / 2**20:.0f} MiB)")
    if "baseline" not in rows:
        return
    b, bkv = rows["baseline"]
    for name, (p, kv) in rows.items():
        if name == "baseline" or p["projected"] or not kv.get("tokens"):
            continue
        knee_b, knee_v = (bkv.get("probe") or {}).get("knee"), (kv.get("probe") or {}).get("knee")
        print(f"{name:>18}: KV tokens x{kv['tokens'] / bkv['tokens']:.3f} the baseline's (per-token bytes "
              f"x{bkv['bytes_per_token_config'] / kv['bytes_per_token_config']:.0f}), KV pool freed "
              f"{(p['pool_bytes'] - b['pool_bytes']) / 2**20:+.0f} MiB; knee {knee_v} vs baseline {knee_b}"
              + (f" (x{knee_v / knee_b:.2f})" if knee_b and knee_v else ""))


if __name__ == "__main__":
    main()
