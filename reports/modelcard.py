"""The model-card table: per task, baseline and variant scores and recovery, in the Markdown form
published quantized model cards use, plus what those cards leave out.

A card's recovery (variant / baseline) says nothing about whether the difference is more than the
items' noise, nor how many answers changed: two variants at 100% recovery can differ on a tenth of
their answers. So beside it stand the paired difference with its 95% bootstrap interval, the flips
each way and the Holm-adjusted McNemar p, all read from signoff.json (pipeline/stages/signoff.py
owns them); a task whose baseline sits near chance is marked, since a loss cannot show there.

Like the page (render.py), a pure function of the run folder's files.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.runstore import atomic_write_text
from reports.render import collect
from reports.view import Run, read_run

# the names model cards print for the suites they share with ours; the rest print as they are named
TASK_NAMES = {"arc_challenge": "ARC-Challenge", "arc_easy": "ARC-Easy", "hellaswag": "HellaSwag", "mmlu": "MMLU",
              "gsm8k": "GSM8K", "piqa": "PIQA", "siqa": "SIQA", "openbookqa": "OpenBookQA",
              "commonsenseqa": "CommonsenseQA", "asdiv": "ASDiv", "bfcl": "BFCL", "needle": "Needle in a haystack",
              "winogrande": "Winogrande",
              "harmbench": "HarmBench (refusal rate)"}
NEAR_CHANCE = "†"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f}"


def _signed(x: float) -> str:
    return f"{100 * x:+.2f}".replace("-", "−")


def _cell(s: str) -> str:
    """A value safe inside a Markdown table cell (a recipe's names are the user's)."""
    return s.replace("|", "\\|").replace("\n", " ")


def _metric(run: Run, suite: str) -> str:
    base = run.variants.get("baseline")
    sq = base.quality.suites.get(suite) if base and base.quality else None
    shots = (base.quality.settings.get("num_fewshot") if base and base.quality else None)
    metric = "refusal rate" if sq is not None and not sq.pooled else (sq.metric if sq else "acc")
    return f"{metric}, {shots}-shot" if shots is not None else metric


def _scheme(run: Run, name: str) -> str:
    """What quantize.json says it built; the recipe's word for it where nothing was built yet."""
    v = run.variants.get(name)
    if v and v.quantize:
        return v.quantize.scheme
    return next((x.get("scheme", "") for x in run.manifest.get("recipe", {}).get("variants", [])
                 if x.get("name") == name), "")


def variant_table(run: Run, name: str) -> list[str]:
    paired = run.paired(name)
    rows = []
    for s, p in paired.items():
        if "/" not in s and s != "overall":
            # long-context retrieval by length, under its task: where a quantized model loses it first
            rows += [p] + sorted((x for k, x in paired.items() if k.startswith(f"{s}/{LENGTH_SLICE}=")),
                                 key=lambda x: _tokens(x.slice))
    if not rows:
        return []
    head = ["Task", "Metric", "n", "Baseline", name, "Recovery", "Δ, 95% CI (paired)", "Flips ✓→✗ / ✗→✓",
            "McNemar p (Holm)"]
    out = ["| " + " | ".join(_cell(h) for h in head) + " |", "|" + "---|" * len(head)]
    for p in rows + ([paired["overall"]] if "overall" in paired else []):
        suite, _, part = p.slice.partition("/")
        task = ("All scored items, pooled" if p.slice == "overall"
                else (f"↳ {part.split('=', 1)[1]} context" if part else TASK_NAMES.get(suite, suite))
                + (f" {NEAR_CHANCE}" if p.near_chance else ""))
        recovery = f"{100 * p.var_acc / p.base_acc:.1f}%" if p.base_acc > 0 else "—"
        holm = p.mcnemar_p_holm if p.mcnemar_p_holm is not None else p.mcnemar_p
        out.append("| " + " | ".join(_cell(c) for c in (
            task, "" if p.slice == "overall" else _metric(run, p.suite or p.slice), str(p.n), _pct(p.base_acc),
            _pct(p.var_acc), recovery, f"{_signed(p.delta)} [{_signed(p.delta_ci_low)}, {_signed(p.delta_ci_high)}]",
            f"{p.flips_correct_to_wrong} / {p.flips_wrong_to_correct}", f"{holm:.3g}")) + " |")
    return out


LENGTH_SLICE = "context"  # the needle suite's slice by haystack length (pipeline/suites.py)


def _tokens(slice_name: str) -> int:
    digits = "".join(ch for ch in slice_name.split("=", 1)[1] if ch.isdigit())
    return int(digits or 0)


def _drift_line(run: Run, name: str) -> str:
    for v in run.signoff.variants if run.signoff else []:
        if v.variant == name and v.drift is not None:
            d = v.drift
            return (f"Token-level KL divergence to the baseline: {d.kl_mean:.4g} nats/token (95% CI {d.kl_ci_low:.4g}"
                    f"–{d.kl_ci_high:.4g}; a lower bound, top-{d.top_k}), top-1 agreement {100 * d.top1_agreement:.2f}%, "
                    f"perplexity ×{d.ppl_ratio:.4f}, over {d.tokens} tokens.")
    return ""


def model_card(run: Run) -> str:
    """The Markdown: one table per variant, in the recipe's order, with its verdict and what it could not score."""
    m = run.manifest
    base = run.variants.get("baseline")
    lm_eval = base.quality.lm_eval_version if base and base.quality else None
    lines = [f"# {m.get('recipe_name', 'run')}: quantized variants against the baseline", "",
             f"Model `{m.get('model_dir', '?')}`, served by {m.get('engine_kind') or 'vllm'}"
             + (f"; scored by lm-eval {lm_eval}" if lm_eval else "") + ". Scores in %, on the items each row counts "
             "(n, the same items for both: a sample, not the whole test set, where the recipe limits it). Recovery is "
             "variant / baseline as published model cards print it; the paired Δ, its 95% bootstrap interval, the "
             "flips and McNemar's p (Holm-adjusted across the variant's suites and slices) are what those cards leave "
             "out: a recovery near 100% can hide answers that changed both ways.", "",
             f"{NEAR_CHANCE} the baseline's interval reaches chance on this task: a loss cannot show here, so its "
             "recovery says nothing.", ""]
    verdicts = {v.variant: v for v in run.signoff.variants} if run.signoff else {}
    if not verdicts:
        lines += ["No sign-off in this run folder (signoff.json): the run did not finish; nothing to compare.", ""]
    for name in [n for n in run.variants if n != "baseline"]:
        v = verdicts.get(name)
        scheme = _scheme(run, name)
        lines.append(f"## {name}" + (f" ({scheme})" if scheme else "")
                     + (f": {v.verdict}" if v else ""))
        lines.append("")
        table = variant_table(run, name)
        if table:
            lines += table + [""]
        else:
            why = (v.reason if v and v.reason else "no paired quality results for it")
            lines += [f"Not scored: {why}.", ""]
        if drift := _drift_line(run, name):
            lines += [drift, ""]
    return "\n".join(lines)


def write_model_card(run_dir: Path) -> Path:
    """RUN/model-card.md from the run folder's files (ReportError when it is not a run folder)."""
    out = run_dir / "model-card.md"
    atomic_write_text(out, model_card(read_run(collect(run_dir), run_dir)))
    return out
