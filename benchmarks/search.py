"""The search on the default model: does its answer replicate on data it never read, at what bytes, within 6
candidate builds?

    python3 benchmarks/search.py [RUN_DIR ...] [--splits N] [--cold]

Runs `quantize-eval search recipes/search.yaml --fresh` once per split seed 0..N-1 (default 1): each seed cuts
the quality data into another search half (the ladder reads it) and sealed half (the answer is signed off on
it: other essays, the code windows, the other half of each suite). Candidates and their scores are cached by
what they are, not by the split, so a later seed builds only the candidates its own ladder reaches that no
earlier one did. --cold runs them all in one temporary cache home (environments, converted model and data this
machine's; result and checkpoint caches empty at the first seed). With RUN_DIRs, reads finished searches instead.

Prints every candidate and reference of each split (search-half and sealed-half verdict and top-1, weights),
then, over the splits:
    replication   of the answers the search data alone would give, the fraction that pass their sealed half
                  (target >= 9 of 10 over >= 10 splits)
    bytes         each confirmed answer's weights as loaded natively / W8A8-INT8's (target <= 0.82)
    builds        candidates per split (cap 6) and how many each invocation built
and appends one row to benchmarks/results/search.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as bench_results  # noqa: E402

from benchmarks.default_run import cold_home  # noqa: E402

MIB = 2**20
PASSING = ("PASS", "WARN")


def run_search(seed: int, env: dict, tmp: Path) -> tuple[Path, float]:
    """One search with this split seed, from a copy of recipes/search.yaml; its run folder and wall time."""
    data = yaml.safe_load((ROOT / "recipes" / "search.yaml").read_text())
    data["search"]["split_seed"] = seed
    data["runs_dir"] = str(ROOT / "runs")
    recipe = tmp / f"search-seed{seed}.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    before = set((ROOT / "runs").glob("search-*"))
    t0 = time.perf_counter()
    proc = subprocess.run([str(ROOT / "quantize-eval"), "search", str(recipe), "--fresh", "--quiet"], cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        sys.exit(f"the search with split seed {seed} failed (exit {proc.returncode})")
    return sorted(set((ROOT / "runs").glob("search-*")) - before)[-1], wall


def ci(pair) -> str:
    return f"[{pair[0]:.3f}, {pair[1]:.3f}]" if pair and pair[0] is not None else ""


def top1(r: dict | None) -> str:
    return f"{r['top1_agreement']:.3f} {ci(r.get('top1_ci'))}" if r and r.get("top1_agreement") is not None else "-"


def one_split(run_dir: Path, wall: float | None) -> dict:
    """Print one split's search and return its figures."""
    s = json.loads((run_dir / "search" / "search.json").read_text())
    if s.get("error"):
        sys.exit(f"{run_dir}: the search failed: {s['error']}")
    print(f"\nrun: {run_dir} (split seed {s.get('split_seed')})")
    rows = s["rows"] + s["references"]
    for r in rows:
        z = r.get("sealed") or {}
        weights = f"{r['native_weight_bytes'] / MIB:.1f} MiB" if r["native_weight_bytes"] else "-"
        code = top1({"top1_agreement": z.get("code_top1_agreement"), "top1_ci": z.get("code_top1_ci")})
        print(f"  {r['name']:>20}  k={r['k']!s:>4}  search {r['verdict']:<12} top-1 {top1(r):<24} "
              f"sealed {z.get('verdict', '-'):<12} top-1 {top1(z):<24} code {code}  "
              f"{weights}  {'built' if r['built_now'] else 'cached/ref'}{'  ANSWER' if r['name'] == s['answer'] else ''}")
    by = {r["name"]: r for r in rows}
    ref = next((r for r in s["references"] if r["name"].startswith("w8a8")), None)
    picked, answer = by.get(s.get("search_answer") or ""), by.get(s.get("answer") or "")
    ratio = (answer["native_weight_bytes"] / ref["native_weight_bytes"]
             if answer and ref and ref["native_weight_bytes"] else None)
    out = {"seed": s.get("split_seed"), "picked": picked["name"] if picked else None,
           "replicates": (picked["sealed"]["verdict"] in PASSING) if picked else None,
           "answer": s["answer"], "ratio": ratio, "candidates": s["candidates"], "built": s["built_now"],
           "gap": s.get("winners_curse") or {}, "wall": wall}
    print(f"  search data's pick: {out['picked']} (sealed: {picked['sealed']['verdict'] if picked else '-'}); "
          f"confirmed answer: {out['answer']}" + (f", {ratio:.3f} x W8A8-INT8's weights" if ratio else "")
          + f"; winner's curse (search - sealed): {out['gap']}; {out['candidates']} candidates, {out['built']} built")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="*", type=Path, help="read these finished search folders instead of running")
    ap.add_argument("--splits", type=int, default=1, help="split seeds 0..N-1, one search each")
    ap.add_argument("--cold", action="store_true", help="empty result and checkpoint caches at the first seed")
    args = ap.parse_args()
    figures = []
    if args.run_dirs:
        figures = [one_split(d, None) for d in args.run_dirs]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, **({"QUANTIZE_EVAL_HOME": str(cold_home(Path(tmp)))} if args.cold else {})}
            for seed in range(args.splits):
                figures.append(one_split(*run_search(seed, env, Path(tmp))))
    picked = [f for f in figures if f["picked"]]
    held = sum(f["replicates"] for f in picked)
    ratios = [f["ratio"] for f in figures if f["ratio"] is not None]
    walls = [f["wall"] for f in figures if f["wall"] is not None]
    print(f"\nreplication: {held} of {len(picked)} search picks passed their sealed half "
          f"(target >= 9 of 10 over >= 10 splits; {len(figures)} split(s) here)")
    if ratios:
        print(f"bytes: confirmed answers at {bench_results.spread(ratios, 'x W8A8-INT8', 3)} (target <= 0.82)")
    print(f"confirmed: {len(ratios)} of {len(figures)} splits; candidates per split: "
          f"{[f['candidates'] for f in figures]} (cap 6), built: {[f['built'] for f in figures]}")
    if args.run_dirs:
        return
    path = bench_results.append(
        "search", "Search: replication on sealed data and bytes (benchmarks/search.py)",
        ["splits", "replication (search picks passing sealed)", "confirmed answers / W8A8-INT8 weights",
         "answers (seed: search pick -> confirmed)", "candidates per split (built)", "wall per split"],
        [str(len(figures)), f"{held} of {len(picked)}",
         bench_results.spread(ratios, "x", 3) if ratios else "none confirmed",
         "; ".join(f"{f['seed']}: {f['picked']} -> {f['answer']}" for f in figures),
         ", ".join(f"{f['candidates']} ({f['built']})" for f in figures),
         bench_results.spread(walls) if walls else "-"])
    print(f"results: {path}")
    if walls:
        print(f"wall: median {statistics.median(walls):.0f} s per split")


if __name__ == "__main__":
    main()
