"""Capacity under one memory budget: what W8A8 (and an FP8 KV cache) free, as KV tokens and requests.

    python3 benchmarks/capacity.py [RUN_DIR]      (default: run recipes/capacity.yaml now, then read it)
    python3 benchmarks/capacity.py --sweep [--model default|gqa] [--budgets 2.875,3,3.5,4.5] [--variants a,b]
    python3 benchmarks/capacity.py --sweep --read runs/capacity-sweep-…   (an earlier sweep's runs, rewritten)

Prints, per variant, the pool plan (budget, weights predicted / as the engine loaded them, what the run
keeps outside each engine's own sizing, the runtime predicted and as the engine held it, the pool
predicted and as the engine chose it), KV tokens by the arithmetic on the pool the engine logged and as
the engine reported them, requests of the workload's shape and the measured admission knee, and each
engine's peak beside the budget and its tolerance.

`--sweep` runs recipes/capacity.yaml once per budget (a copy of it with only the budget changed, the
serving cell measured once per engine rather than four times: quantization, quality and the engine
agreement come from the caches after the first), so every variant an engine serves natively here is
engine-sized at every budget. Per variant and budget it writes to benchmarks/results/capacity.md: the
engine's KV tokens, the tokens the report's across-budgets arithmetic (membudget.pool_at) predicts there
from the engine at the reference budget (the middle one), requests of the workload's shape, the measured
knee and what bound it, and the engine's serving peak against the budget and its tolerance. A variant no
engine runs natively on this kind is listed as projected (arithmetic only), never as measured.
`--model gqa` sweeps a second, larger architecture with grouped-query attention: Qwen2.5-0.5B's shapes
(Qwen2, 24 layers, 14 query heads to 2 KV heads, head_dim 64) built from its config with seeded random
weights and the default model's tokenizer (vocabulary cut to its 49,152 tokens): capacity depends on the
shapes, not the weights, so its quality figures (20 PIQA items, near chance) are not a finding.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GIB = 2**30
RECIPE = ROOT / "recipes" / "capacity.yaml"
BUDGETS = {"default": "2.875,3,3.5,4.5", "gqa": "4,4.5,5,6"}


def run_recipe() -> Path:
    before = set((ROOT / "runs").glob("capacity-*"))
    proc = subprocess.run([str(ROOT / "quantize-eval"), "recipes/capacity.yaml", "--fresh", "--quiet"], cwd=ROOT)
    if proc.returncode not in (0, 1, 4, 5):  # a verdict, whichever (2: bad input, 3: compare)
        sys.exit(f"the run failed (exit {proc.returncode})")
    return sorted(set((ROOT / "runs").glob("capacity-*")) - before)[-1]


def b_pred(data: dict) -> str:
    p = (((data["variants"].get("baseline") or {}).get("systems") or {}).get("kv") or {}).get("plan") or {}
    return f"{p.get('predicted_tokens')} tokens, {p.get('predicted_admitted')} requests"


def main(run: Path | None) -> None:
    run = run or run_recipe()
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


def gqa_model() -> Path:
    """The second architecture, built once into the home's models folder (tests/tinymodel.py builds it in
    the engine environment, which has transformers)."""
    from pipeline.setup import envs

    out = envs.home() / "models" / "qwen2.5-0.5b-shape-random"
    if not (out / "config.json").exists():
        py = envs.ensure("engine")
        code = "import sys; from pathlib import Path; from tests.tinymodel import build_qwen2_shape; " \
               "build_qwen2_shape(Path(sys.argv[1]))"
        subprocess.run([str(py), "-c", code, str(out)], cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out


def sweep_recipe(model: str, budget: float, variants: list[str] | None, runs: Path) -> Path:
    """A copy of recipes/capacity.yaml at this budget, its runs under the sweep's folder."""
    r = yaml.safe_load(RECIPE.read_text())
    r = copy.deepcopy(r)
    r["name"] = f"capacity-{model}-{budget:g}gib"
    r["engine"]["memory_budget_gib"] = budget
    r["runs_dir"] = str(runs.relative_to(ROOT))
    # one measured cell per engine: the sweep reads capacity; latency is the default run's business
    r["workload"].update(repeats=1)
    if variants:
        r["variants"] = [v for v in r["variants"] if v["name"] in variants]
    if model == "gqa":
        r["model"] = {"path": str(gqa_model())}
        r["quality"] = {"suites": ["piqa"], "limit": 20, "noise_floor": False, "agreement_sample": 0}
        r["gates"] = [g for g in r["gates"] if g["metric"] != "accuracy_delta"]
    path = runs / f"{r['name']}.yaml"
    path.write_text(yaml.safe_dump(r, sort_keys=False))
    return path


def measured(run: Path) -> dict[str, dict]:
    """Per variant of one run: its plan and capacity figures (or why it has none)."""
    data = json.loads((run / "results.json").read_text())
    why = {v["variant"]: f"{v['verdict']}: {v.get('reason', '')}" for v in (data.get("signoff") or {}).get("variants", [])}
    out = {}
    for name, r in data["variants"].items():
        s = r.get("systems") or {}
        kv = s.get("kv") or {}
        p = kv.get("plan")
        if not p:
            out[name] = {"error": s.get("error") or r.get("error") or why.get(name) or "not evaluated"}
            continue
        probe = kv.get("probe") or {}
        out[name] = {"plan": p, "tokens": kv.get("tokens"), "knee": probe.get("knee"),
                     "binding": probe.get("binding"), "max_num_seqs": data["manifest"]["recipe"]["engine"]["max_num_seqs"],
                     "run": run.name}
    return out


def sweep(args) -> None:
    from benchmarks import results
    from pipeline.measure.membudget import pool_at

    budgets = [float(b) for b in (args.budgets or BUDGETS[args.model]).split(",")]
    variants = args.variants.split(",") if args.variants else None
    import datetime as dt

    by_budget = {}
    if args.read:  # an earlier sweep's folder: its runs, newest per budget, nothing run again
        runs = Path(args.read).resolve()
        for folder in sorted(x for x in runs.iterdir() if (x / "results.json").exists()):
            m = json.loads((folder / "results.json").read_text())["manifest"]["recipe"]["engine"]
            by_budget[float(m["memory_budget_gib"])] = measured(folder)
        budgets = sorted(by_budget)
    else:
        runs = ROOT / "runs" / f"capacity-sweep-{args.model}-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}"
        runs.mkdir(parents=True)
    for b in ([] if args.read else budgets):
        recipe = sweep_recipe(args.model, b, variants, runs)
        before = set(runs.glob(f"{recipe.stem}-*"))
        print(f"[sweep] {args.model} model at {b:g} GiB: {recipe.relative_to(ROOT)}", flush=True)
        proc = subprocess.run([str(ROOT / "quantize-eval"), str(recipe), "--fresh", "--quiet"], cwd=ROOT)
        made = sorted(set(runs.glob(f"{recipe.stem}-*")) - before)
        if proc.returncode not in (0, 1, 4, 5) or not made or not (made[-1] / "results.json").exists():
            sys.exit(f"the run at {b:g} GiB failed (exit {proc.returncode}); its recipe: {recipe}")
        by_budget[b] = measured(made[-1])
    ref = budgets[len(budgets) // 2]
    header = ["model", "variant", "budget GiB", "KV tokens (engine)", f"KV tokens by the arithmetic from the "
              f"{ref:g} GiB engine", "requests @shape (KV bound)", "knee measured (what bound it)",
              "serving peak GiB (tolerance)", "run"]
    title = ("Capacity across budgets: every engine sized by vLLM itself under each budget, beside the "
             "arithmetic the report draws between budgets")
    names = list(by_budget[budgets[0]])
    for name in names:
        r0 = by_budget[ref].get(name) or {}
        p0 = r0.get("plan") or {}
        non_kv = (p0.get("sizing") or {}).get("non_kv_bytes")
        for b in budgets:
            m = by_budget[b].get(name) or {"error": "absent"}
            if "error" in m:
                row = [args.model, name, f"{b:g}", "—", "—", "—", "—", "—", f"no figures: {m['error']}"]
            elif m["plan"]["projected"]:
                p = m["plan"]
                row = [args.model, name, f"{b:g}", "projected (no engine runs it natively here)",
                       f"{p['tokens']} (arithmetic only)", f"{p['admitted']} (arithmetic only)", "—", "—", m["run"]]
            else:
                p = m["plan"]
                arith = "—"
                if non_kv is not None and p0.get("outside_bytes") is not None and m["tokens"]:
                    pool = pool_at(int(b * GIB), p0["outside_bytes"], non_kv)
                    tokens = pool // p["kv_bytes_per_block"] * p["block_size"]
                    diff = (m["tokens"] - tokens) // p["block_size"]
                    arith = f"{tokens} ({diff:+d} blocks)" if b != ref else "(the reference)"
                peak, tol = p.get("peak_bytes") or 0, p.get("tolerance_bytes") or 0
                kept = "kept" if peak <= p["budget_bytes"] + tol else f"OVER by {(peak - p['budget_bytes']) / 2**20:.0f} MiB"
                bound = ("max_num_seqs" if m["knee"] == m["max_num_seqs"] else m["binding"] or "?")
                row = [args.model, name, f"{b:g}", str(m["tokens"]), arith, str(p["admitted"]),
                       f"{m['knee']} ({bound})", f"{peak / GIB:.2f} ({kept}, {tol / 2**20:.0f} MiB)", m["run"]]
            results.append("capacity", title, header, row)
            print("  " + " | ".join(row))
    for b in budgets:
        base = by_budget[b].get("baseline") or {}
        for name, m in by_budget[b].items():
            if name == "baseline" or "error" in m or "error" in base or m["plan"]["projected"] or not base:
                continue
            print(f"at {b:g} GiB: {name} KV tokens x{m['tokens'] / base['tokens']:.3f}, knee {m['knee']} vs "
                  f"baseline {base['knee']}")
    print(f"figures: {(ROOT / 'benchmarks' / 'results' / 'capacity.md').relative_to(ROOT)}; runs: {runs.relative_to(ROOT)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", help="read this run folder instead of running recipes/capacity.yaml")
    ap.add_argument("--sweep", action="store_true", help="one run per budget, figures to the results file")
    ap.add_argument("--model", choices=sorted(BUDGETS), default="default")
    ap.add_argument("--budgets", help="comma-separated GiB (default: per model)")
    ap.add_argument("--read", metavar="SWEEP_DIR", help="write the figures of an earlier sweep's folder, running nothing")
    ap.add_argument("--variants", help="comma-separated variant names of recipes/capacity.yaml to keep")
    a = ap.parse_args()
    if a.sweep:
        sweep(a)
    else:
        main(Path(a.run) if a.run else None)
