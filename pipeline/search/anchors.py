"""Head-to-head with the anchors (search.anchors): another tool's choice of which layers get 8-bit weights, at
the same average bits as the search data's pick, built and judged exactly as the search's own candidates.

    choice      the tool runs in the quantize environment (pipeline/engines/workers/anchor_worker.py): it counts
                the pick's bits its own way, then chooses per Linear layer between the base 4-bit scheme and
                8-bit weights at that average (cached by model, tool, pick and calibration)
    build       that choice as a `scheme: custom` checkpoint from the search's own base scheme and group size
                (mixed.candidate_recipe), so the two differ only in which layers were kept
    judged      on the search half and, with every other point, on the sealed half: compared on the frontier,
                never the answer (its bits were matched to a pick the search data made)

Only the layer choice is the tool's: its own rounding (auto-round's tuning) is not run, so the head-to-head
asks which layers to keep, the question the ladder answers.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline import schemes
from pipeline.engines.workers.sensitivity_parts import kept_modules
from pipeline.measure.split import Split
from pipeline.progress import say
from pipeline.run import runner
from pipeline.runstore import hash_obj, sha256_file, write_json
from pipeline.search import mixed, points
from pipeline.setup import assets, envs
from pipeline.store import keys, outcome
from pipeline.store.outcome import Spent

WORKER = keys.PIPELINE / "engines" / "workers" / "anchor_worker.py"
LABEL = {"auto_round": "auto-round AutoScheme", "modelopt": "ModelOpt auto_quantize"}
EXTRA = {"modelopt": "modelopt"}  # installed into the quantize environment on first use (requirements/extra-*.txt)
# vLLM serves q/k/v as one fused Linear and gate/up as another: a layer choice that splits either cannot load
SHARED = [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]


def name_of(tool: str) -> str:
    return f"anchor-{tool.replace('_', '')}"


def worker_spec(recipe, model_dir: Path, tool: str, eight_bit: list[str], modules: list[str]) -> dict:
    """What the anchor worker is asked (anchor-spec.json): the tool, the pick's 8-bit layers whose average bits
    it must match, the two widths it chooses between (the search's base scheme and 8-bit per channel)."""
    sp, c = recipe.search, recipe.calibration
    base = schemes.SCHEMES[sp.base_scheme]
    return {"tool": tool, "model_dir": str(model_dir), "modules": modules, "eight_bit": sorted(eight_bit),
            "bits": base.weight_bits, "group_size": sp.group_size, "symmetric": base.symmetric, "shared": SHARED,
            "calibration": {"calibration_file": str(assets.calibration_text(c.dataset)),
                            "num_samples": c.num_samples, "max_seq_len": c.max_seq_len},
            "seed": recipe.engine.seed}


def cache_key(spec: dict, model_id: str) -> str:
    what = {k: v for k, v in spec.items() if k not in ("model_dir", "calibration")}
    what["calibration"] = {**{k: v for k, v in spec["calibration"].items() if k != "calibration_file"},
                           "sha256": sha256_file(Path(spec["calibration"]["calibration_file"]))}
    extra = EXTRA.get(spec["tool"])
    return hash_obj({"model": model_id, **what, "code": keys.source_hash(WORKER),
                     "quantize_env": envs.requirements_file("quantize").read_text(),
                     "extra": (envs.REQUIREMENTS / f"extra-{extra}.txt").read_text() if extra else None})


def choose_layers(ctx, spec: dict, spent: Spent) -> dict:
    """The tool's choice (the worker's result), from the cache when made before."""
    out_dir = ctx.run_dir.root / "search"
    cache = envs.home() / "results" / "anchors" / f"{cache_key(spec, ctx.model_id)[:32]}.json"
    if not cache.exists():
        tool = spec["tool"]
        if tool in EXTRA:
            envs.ensure_extra(EXTRA[tool], python=envs.ensure("quantize"), no_deps=True)
        (out_dir / f"anchor-{tool}-spec.json").write_text(json.dumps(spec))
        tmp = out_dir / f"anchor-{tool}-worker.json"
        tmp.unlink(missing_ok=True)
        envs.run_quantize_env("pipeline.engines.workers.anchor_worker",
                              [str(out_dir / f"anchor-{tool}-spec.json"), str(tmp)], out_dir / f"anchor-{tool}.log",
                              ctx.recipe.calibration.timeout_s, f"{LABEL[tool]} layer choice", spent, label="search")
        write_json(cache, json.loads(tmp.read_text()))
        tmp.unlink()
    return json.loads(cache.read_text())


def target_of(picked: dict | None) -> str | None:
    """Why no anchor can be matched to this pick, or None when one can: the pick must be a mixed candidate
    whose kept parts are at 8-bit weights (a uniform scheme or a reference has no layer choice to compare)."""
    if picked is None:
        return "nothing passed on the search data, so there are no bits to match"
    if picked["kind"] != "candidate" or not picked.get("k"):
        return f"the search data's pick {picked['name']} is not a mixed candidate: there is no layer choice to match"
    if picked.get("fallback") != "w8a16":
        return f"the search data's pick {picked['name']} keeps its parts unquantized, not at 8-bit weights"
    return None


def anchor_points(ctx, manifest: dict, ranked: list[dict], modules: list[str], picked: dict | None,
                  look: Split) -> tuple[list[dict], list[dict]]:
    """(each anchor's row, judged on the search half; what each anchor run came to, with why where it did not)."""
    sp = ctx.recipe.search
    rows, runs = [], []
    for tool in sp.anchors:
        why = target_of(picked)
        if why:
            say("search", f"{LABEL[tool]}: not compared ({why})")
            runs.append({"tool": tool, "label": LABEL[tool], "skipped": why})
            continue
        t0, spent = time.time(), Spent()
        try:
            choice = choose_layers(ctx, worker_spec(ctx.recipe, ctx.model_dir, tool,
                                                    kept_modules(ranked, picked["k"]), modules), spent)
        finally:
            outcome.record(ctx.run_dir.root, "search", f"anchor {tool}", t0, spent)
        eight = set(choice["eight_bit"])
        llmc = mixed.candidate_recipe(sp.base_scheme, sp.group_size, "w8a16", [m for m in modules if m not in eight],
                                      sorted(eight), ["lm_head"])
        name = name_of(tool)
        v = points.custom_variant(ctx, name, llmc)
        say(name, f"{LABEL[tool]} at {choice['avg_bits_target']:.3f} bits (the pick {picked['name']}'s, counted its "
                  f"way): {len(eight)} of {len(modules)} Linear layers at 8-bit weights")
        runner.run_stage(ctx, name)
        row = points.row_of(ctx, name, points.judge(ctx, manifest, v, look), "anchor", "w8a16", None, sorted(eight))
        run = {"tool": tool, "label": LABEL[tool], "matched": picked["name"], **{
            k: choice.get(k) for k in ("version", "avg_bits_target", "avg_bits_achieved", "range", "wall_s")}}
        row["anchor"] = run
        say(name, f"search: {row['verdict']} on search data" + (f" ({row['reason']})" if row["reason"] else ""))
        rows.append(row)
        runs.append(run)
    return rows, runs
