"""One measured point of a search's frontier: a candidate's, a KV-cache twin's, an anchor's or a reference's
row, each judged on one half of the quality data (pipeline/measure/split.py), and the points served after the
ladder without a build of their own (KV-cache twins).

Every figure in a row is read back from what the run stored for that variant (its outcome and sign-off);
nothing here measures. The ladder (ladder.py) builds candidates and asks for their rows; sealed.py judges them.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.measure import membudget, metrics
from pipeline.measure.split import Split
from pipeline.progress import say
from pipeline.recipe.schema import VariantSpec
from pipeline.run import runner
from pipeline.runstore import atomic_write_text, hash_obj
from pipeline.search import sealed
from pipeline.setup import envs, modelcfg
from pipeline.store import outcome, provenance


def llmc_file(llmc: dict) -> Path:
    """Content-addressed, so the same candidate is the same checkpoint (and results) in any later search."""
    path = envs.home() / "search-recipes" / f"{hash_obj(llmc)[:20]}.yaml"
    if not path.exists():
        atomic_write_text(path, yaml.safe_dump(llmc, sort_keys=False))
    return path


def add_variant(ctx, v: VariantSpec) -> None:
    """A point the search serves becomes one of the run's variants (once), so runner and sign-off see it."""
    if v.name not in {x.name for x in ctx.recipe.variants}:
        ctx.recipe = ctx.recipe.model_copy(update={"variants": (*ctx.recipe.variants, v)})


def custom_variant(ctx, name: str, llmc: dict) -> VariantSpec:
    """A mixed checkpoint's llm-compressor recipe as a `scheme: custom` variant of the run, its recipe file kept
    beside the run (RUN/search/NAME.llmc.yaml)."""
    path = llmc_file(llmc)
    (ctx.run_dir.root / "search" / f"{name}.llmc.yaml").write_text(path.read_text())
    v = VariantSpec(name=name, scheme="custom", recipe=str(path))
    add_variant(ctx, v)
    return v


def _native_weight_bytes(weights_dir: Path, model_dir: Path) -> int:
    """Weights as a native kernel holds them, floats in the model's own dtype (the 4-bit CPU kernel needs
    bfloat16; GPUs serve 16-bit), so every candidate and reference is counted alike on any host."""
    cfg = modelcfg.read(model_dir)
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return membudget.weights_as_loaded(weights_dir, provenance.dtype_bytes(dtype))


def row_of(ctx, name: str, verdict, kind: str, fallback: str | None = None, k: int | None = None,
           kept: list[str] | None = None) -> dict:
    """One point of the frontier: what was measured of a candidate or reference."""
    o = outcome.read(ctx.run_dir.variant(name))
    s, qr = o.systems, o.quantize
    weights_dir = Path(qr.checkpoint_dir) if qr else ctx.model_dir
    # served from the base weights as they are (a KV-cache-only variant); bitsandbytes NF4, quantized by
    # the engine at load, has no checkpoint to count and is left without a figure
    base_weights = any(v.name == name and v.scheme == "none" for v in ctx.recipe.variants)
    gates = sealed.gate_rows(verdict.gates if verdict else [])
    spec = next((v for v in ctx.recipe.variants if v.name == name), None)
    row = {
        "name": name, "kind": kind, "fallback": fallback, "k": k, "kept": kept or [],
        "kv_cache": spec.kv_cache if spec else "auto",
        "verdict": verdict.verdict if verdict else "FAILED-TO-RUN", "reason": verdict.reason if verdict else o.error,
        "gates": gates, "checkpoint_bytes": qr.checkpoint_bytes if qr else None,
        "native_weight_bytes": _native_weight_bytes(weights_dir, ctx.model_dir) if qr or base_weights else None,
        "kv_tokens": kv_tokens(s), "kv_projected": bool(s and s.kv and s.kv.plan and s.kv.plan.projected),
        **sealed.quality_fields(verdict),
        **_tpot_p95(s),
        "built_now": False, "quantize_wall_s": qr.quantize_wall_s if qr else None,
    }
    row["search_pass"] = sealed.passes_search(row)  # the ladder's look, with the replication margin
    return row


def _tpot_p95(s) -> dict:
    """p95 TPOT as a latency gate would read it: the repeats' geometric mean with its 95% interval (or the figure
    over all requests without one); none where the variant was not served natively (emulated weights)."""
    if not (s and s.status == "ok" and s.latency):
        return {"tpot_p95_ms": None, "tpot_p95_ci": None}
    m = metrics.latency_ms(s, "tpot", "p95")
    return {"tpot_p95_ms": m.value, "tpot_p95_ci": [m.ci_low, m.ci_high] if m.ci_low is not None else None}


def kv_tokens(s) -> int | None:
    """KV tokens the engine held under the budget, or, for a variant served as dense weights, the tokens
    its checkpoint's native weights would leave (the projected plan)."""
    if s is None or s.kv is None:
        return None
    return s.kv.tokens if s.kv.tokens is not None else (s.kv.plan.tokens if s.kv.plan else None)


def judge(ctx, manifest: dict, v: VariantSpec, half: Split):
    """One variant's sign-off on one half of the quality data (search or sealed)."""
    from pipeline.stages.signoff import signoff

    one = ctx.recipe.model_copy(update={"variants": (v,)})
    results = {n: outcome.read(ctx.run_dir.variant(n)) for n in ("baseline", v.name)}
    return signoff(one, manifest["recipe_hash"], ctx.run_dir.root, results, half).variants[0]


def kv_twins(ctx, manifest: dict, rows: list[dict], kv_cache: tuple[str, ...], look: Split) -> list[dict]:
    """Each candidate that passed on the search data, served again with each other KV-cache precision: the
    same checkpoint (no build), its own engine, quality and systems, judged like any candidate."""
    twins = []
    for kv in (x for x in kv_cache if x != "auto"):
        for r in [r for r in rows if r["search_pass"] and r.get("kv_cache", "auto") == "auto"]:
            base = next(v for v in ctx.recipe.variants if v.name == r["name"])
            v = base.model_copy(update={"name": f"{r['name']}-kv{kv}", "kv_cache": kv})
            add_variant(ctx, v)
            say(v.name, f"search: {r['name']} with a {kv} KV cache (the same checkpoint)")
            runner.run_stage(ctx, v.name)
            verdict = judge(ctx, manifest, v, look)
            row = row_of(ctx, v.name, verdict, "candidate", r["fallback"], r["k"], r["kept"])
            row["parent"] = r["name"]
            say(v.name, f"search: {row['verdict']} on search data" + (f" ({row['reason']})" if row["reason"] else "")
                + (f"; {row['kv_tokens']:,} KV tokens under the budget" if row["kv_tokens"] else ""))
            twins.append(row)
    return twins


def kv_space(rows: list[dict], sp) -> dict:
    """Per KV-cache precision in the space: how many candidates were served with it and, where none could be,
    why (the engine's own refusal), so a capacity search that could not use it says so."""
    out = {}
    for kv in sp.kv_cache:
        mine = [r for r in rows if r.get("kv_cache", "auto") == kv]
        skipped = [r for r in mine if r["verdict"] == "SKIPPED"]
        out[kv] = {"served": len(mine) - len(skipped), "skipped": len(skipped),
                   "why": skipped[0]["reason"] if skipped and len(skipped) == len(mine) else None}
    if sp.objective == "capacity" and len(sp.kv_cache) > 1 and not any(
            out[kv]["served"] for kv in sp.kv_cache if kv != "auto"):
        out["note"] = ("no candidate ran with another KV-cache precision here, so capacity ranked the candidates "
                       "by their weights alone, as memory does")
    return out


