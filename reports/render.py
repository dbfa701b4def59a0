"""Render a run folder into one self-contained report.html plus results.json and results.csv.

A pure function of the files in the run folder: it never imports stage code or engines,
so `quantize-eval report RUN_DIR` rebuilds the page from saved JSON alone. The page has
inline CSS and inline SVG, no scripts it needs and no network; every string that came
from a model, a dataset or a recipe is HTML-escaped.

This module gathers the files (`collect`, written as results.json in its established shape),
writes the CSV and assembles the page; each section lives with its kind: verdict.py, quality.py,
charts.py, systems.py, provenance.py, reading the typed view of view.py.
"""

from __future__ import annotations

import csv
import io
import json
from html import escape
from pathlib import Path

from pipeline.runstore import atomic_write_text, write_json
from reports.capacity import capacity_section, plan_of, requests_that_fit, tradeoff_section
from reports.charts import chart_section, pareto
from reports.html import CSS
from reports.provenance import provenance_section, schemes_section
from reports.quality import drift_section, flips_section, heatmap_section, quality_section
from reports.search import search_banner, search_section
from reports.systems import admission_section, latency_section, matrix_section, memory_section, roofline_section
from reports.verdict import gates_section, verdict_section
from reports.view import Run, read_run

__all__ = ["CSV_COLUMNS", "ReportError", "collect", "mark_incomplete", "pareto", "render_html", "render_run", "to_csv"]


class ReportError(Exception):
    pass


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect(run_dir: Path) -> dict:
    """Everything the run wrote, merged into one JSON-able dict (results.json)."""
    manifest = _load(run_dir / "manifest.json")
    if manifest is None:
        raise ReportError(f"{run_dir}: not a run folder (no readable manifest.json)")
    signoff = _load(run_dir / "signoff.json")
    names = ["baseline", *[v["name"] for v in manifest["recipe"]["variants"]]]
    variants = {}
    for name in names:
        vdir = run_dir / name
        variants[name] = {stage: _load(vdir / f"{stage}.json")
                          for stage in ("quantize", "quality", "systems", "error", "support", "agreement",
                                        "quality.origin", "systems.origin")}
    out = {"schema_version": 1, "manifest": manifest, "signoff": signoff, "variants": variants}
    search = _load(run_dir / "search" / "search.json")
    if search is not None:
        out["search"] = search
    return out


CSV_COLUMNS = ["variant", "verdict", "slice", "n", "base_acc", "var_acc", "delta", "delta_ci_low",
               "delta_ci_high", "flips_correct_to_wrong", "flips_wrong_to_correct", "mcnemar_p",
               "checkpoint_bytes", "peak_memory_bytes", "kv_tokens", "kv_pool_bytes", "requests_that_fit",
               "requests_that_fit_source", "ttft_p50_ms", "ttft_p99_ms",
               "tpot_p50_ms", "tpot_p99_ms", "output_tok_per_s"]


def _systems_columns(run: Run, name: str) -> dict:
    v = run.variants.get(name)
    s = v.systems if v else None
    lat = s.latency if s else None
    plan = plan_of(v) if v else None
    fits, how = requests_that_fit(v) if v else (None, "")
    return {"checkpoint_bytes": s.checkpoint_bytes if s else None,
            "peak_memory_bytes": s.peak_memory_bytes if s else None,
            "kv_tokens": s.kv.tokens if s and s.kv else None,
            "kv_pool_bytes": plan.pool_bytes if plan else None,
            "requests_that_fit": fits, "requests_that_fit_source": how or None,
            "ttft_p50_ms": lat.ttft_ms.p50 if lat else None, "ttft_p99_ms": lat.ttft_ms.p99 if lat else None,
            "tpot_p50_ms": lat.tpot_ms.p50 if lat else None, "tpot_p99_ms": lat.tpot_ms.p99 if lat else None,
            "output_tok_per_s": lat.output_tok_per_s if lat else None}


def to_csv(data: dict) -> str:
    """One row per variant and slice, with the variant's systems figures repeated."""
    run = read_run(data)
    buf = io.StringIO()
    w = csv.DictWriter(buf, CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for v in run.signoff.variants if run.signoff else []:
        sysrow = _systems_columns(run, v.variant)
        for p in [p.model_dump() for p in v.paired] or [{"slice": ""}]:
            w.writerow({"variant": v.variant, "verdict": v.verdict, **p, **sysrow})
    return buf.getvalue()


def _body(run: Run) -> str:
    """The sections, in reading order: verdict first, provenance last."""
    return (search_banner(run) + verdict_section(run) + search_section(run) + tradeoff_section(run)
            + schemes_section(run) + gates_section(run)
            + quality_section(run) + heatmap_section(run) + drift_section(run) + chart_section(run)
            + capacity_section(run) + memory_section(run) + admission_section(run) + latency_section(run) + roofline_section(run)
            + matrix_section(run) + flips_section(run) + provenance_section(run))


def _engine(m: dict) -> str:
    """The engine every number of the run came from; a quality-only engine says so at the top."""
    kind = m.get("engine_kind") or "vllm"
    if why := m.get("engine_systems_not_measured"):
        return f"{kind}, quality only: {why}"
    return kind


def render_html(data: dict, run_dir: Path) -> str:
    m = data["manifest"]
    raw = json.dumps(data, default=str).replace("<", "\\u003c")  # no tag can open or close in it
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
            f"<title>quantize-eval: {escape(m['recipe_name'])}</title><style>{CSS}</style></head><body>"
            f"<h1>quantize-eval report: {escape(m['recipe_name'])}</h1>"
            f"<div class='muted small'>{escape(str(run_dir))} · model {escape(m['model_dir'])} · served by "
            f"{escape(_engine(m))}</div>"
            + _body(read_run(data, run_dir))
            + f"<script type='application/json' id='results'>{raw}</script></body></html>")


def render_run(run_dir: Path) -> Path:
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: run folder not found")
    data = collect(run_dir)
    write_json(run_dir / "results.json", data)
    atomic_write_text(run_dir / "results.csv", to_csv(data))
    out = run_dir / "report.html"
    atomic_write_text(out, render_html(data, run_dir))
    return out


def mark_incomplete(run_dir: Path, why: str) -> None:
    """The first thing a (re)run does to its folder, before any other work: every output says INCOMPLETE.
    Each file is replaced by an atomic rename, the page first and the verdict's sources (signoff.json, the
    search's answer) last, so a rerun killed at any point leaves no output that shows the last run's
    verdict (the full page follows once the manifest is written)."""
    banner = f"INCOMPLETE — NO VERDICT: {why}"
    atomic_write_text(run_dir / "report.html", f"<!doctype html><meta charset='utf-8'><style>{CSS}</style>"
                      f"<div class='banner INCOMPLETE'>{escape(banner)}</div>")
    write_json(run_dir / "results.json", {"schema_version": 1, "incomplete": why, "manifest": {}, "signoff": None,
                                          "variants": {}})
    atomic_write_text(run_dir / "results.csv", ",".join(CSV_COLUMNS) + "\n")
    (run_dir / "search" / "search.json").unlink(missing_ok=True)
    (run_dir / "signoff.json").unlink(missing_ok=True)
