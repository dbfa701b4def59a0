"""Quality sections: per-suite accuracy paired against the baseline, the slice heatmap, token-level
drift, and the items that flipped.

Accuracies come from each variant's quality.json; deltas, CIs, flips and McNemar p-values from the
sign-off's paired comparisons. The flipped items are read from the samples files the quality stage
wrote beside its result.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from pipeline.measure.stats import wilson
from pipeline.results import PairedSlice, SuiteQuality
from reports.html import fmt, table
from reports.view import Run


def _acc_ci(acc: float, lo: float, hi: float) -> str:
    return f"{fmt(acc, pct=True)} [{fmt(lo, pct=True)}, {fmt(hi, pct=True)}]"


def _delta(p: PairedSlice) -> str:
    return f"{p.delta * 100:+.1f} pt [{p.delta_ci_low * 100:+.1f}, {p.delta_ci_high * 100:+.1f}]"


def _flips(p: PairedSlice) -> str:
    return f"{p.flips_correct_to_wrong} / {p.flips_wrong_to_correct}"


def _failures(s: SuiteQuality) -> str:
    """Misses by failure category (generation), or the count of wrong answers (multiple choice)."""
    cats = s.categories
    if s.kind != "mc":
        return " · ".join(f"{k} {v}" for k, v in sorted(cats.items(), key=lambda kv: -kv[1]) if k != "correct")
    return "wrong " + str(cats.get("wrong", s.n - s.correct))


def _aa(nf) -> str:
    """The engine's own flips on this suite (the baseline scored twice, batched otherwise)."""
    return (f"<span class='small muted'>engine vs itself: {nf.flips_correct_to_wrong} / {nf.flips_wrong_to_correct}"
            f" of {nf.n}{', bit-identical' if nf.identical else ''}</span>") if nf is not None else ""


def _suite_row(name: str, suite: str, s: SuiteQuality, p: PairedSlice | None, nf=None) -> list[str]:
    flips = " ".join(x for x in (_flips(p) if p else "", _aa(nf)) if x) or "–"
    return [escape(name), escape(suite), str(s.n), _acc_ci(s.accuracy, s.ci_low, s.ci_high),
            fmt(s.chance, pct=True), _delta(p) if p else "–", flips,
            f"{fmt(p.mcnemar_p, 3)} ({fmt(p.mcnemar_p_holm, 3)})" if p else "–",
            escape(_failures(s)), "<b>near chance</b>" if s.near_chance else ""]


def _overall_row(name: str, p: PairedSlice) -> list[str]:
    """The paired 'overall' slice: every item the variant shares with the baseline, pooled."""
    lo, hi = wilson(round(p.var_acc * p.n), p.n)
    return [escape(name), "<b>overall</b>", str(p.n), _acc_ci(p.var_acc, lo, hi), "", _delta(p), _flips(p),
            f"{fmt(p.mcnemar_p, 3)} (unadjusted)", "", ""]


def quality_section(run: Run) -> str:
    rows = []
    base = run.variants.get("baseline")
    noise = base.quality.noise_floor if base is not None and base.quality else {}
    for name, v in run.variants.items():
        if not v.quality:
            continue
        paired = run.paired(name)
        rows += [_suite_row(name, suite, s, paired.get(suite), noise.get(suite)) for suite, s in v.quality.suites.items()]
        if "overall" in paired:
            rows.append(_overall_row(name, paired["overall"]))
    return ("<h2>Quality, paired against the baseline</h2><p class='small muted'>Per item: multiple choice "
            "is lm-eval acc_norm (length-normalised loglikelihood; acc for MMLU, whose choices are letters, as lm-eval "
            "reports it); generation is scored by "
            "evalsuites/qe_utils.py (number, tool call, needle word) and every miss gets one failure category "
            "(wrong, malformed, truncated, refusal, empty; on the safety suite, where a refusal is the right answer "
            "and is kept out of overall accuracy, complied; truncation is judged from the re-tokenized output, "
            "so it is approximate). Accuracy with 95% Wilson CI; chance is 1/choices (0 for generation). "
            "Delta is variant − baseline on the same items; its 95% CI is "
            "the union of a paired bootstrap and the Agresti–Min interval (the bootstrap alone collapses "
            "to a point when few items flip). Flips: correct→wrong / wrong→correct; beside them, the flips the engine "
            "makes against itself on the same items (the baseline's items scored again in one engine, batched "
            "otherwise: A/A; every item, or the first 50 of each suite where those came back bit-identical), "
            "so engine noise is not read as a loss; such noise flips both ways, and the paired CI already "
            "holds it. McNemar: exact two-sided p (Holm-adjusted across every suite and slice of the variant).</p>"
            + table(["variant", "suite", "n", "accuracy [95% CI]", "chance", "Δ vs baseline [95% CI]",
                     "flips c→w / w→c", "McNemar p (Holm)", "failures", ""], rows, left=2))


def _heat_cell(p: PairedSlice | None) -> str:
    """Delta in points, coloured by size, bold and starred where significant; flips in brackets."""
    if not p:
        return "–"
    d = p.delta * 100
    a = min(1.0, abs(d) / 10)
    colour = f"rgba(207,34,46,{a:.2f})" if d < 0 else f"rgba(26,127,55,{a:.2f})"
    sig = p.delta_ci_high < 0 or p.delta_ci_low > 0 or (p.mcnemar_p_holm or 1) < 0.05
    txt = f"{d:+.1f}" + (" *" if sig else "")
    return (f"<span style='background:{colour};padding:2px 6px;border-radius:3px'>"
            f"{'<b>' + txt + '</b>' if sig else txt}</span> "
            f"<span class='small muted'>({p.flips_correct_to_wrong}↓/{p.flips_wrong_to_correct}↑)</span>")


def heatmap_section(run: Run) -> str:
    """Slice (rows) x variant (columns), in the order the slices first appear."""
    variants = run.signoff.variants if run.signoff else []
    first: dict[str, PairedSlice] = {}
    for v in variants:
        for p in v.paired:
            first.setdefault(p.slice, p)
    if not first:
        return ""
    by = {v.variant: run.paired(v.variant) for v in variants}
    rows = []
    for sl, ref in first.items():
        label = escape(sl) if "/" not in sl else "&nbsp;&nbsp;" + escape(sl.split("/", 1)[1])
        rows.append([f"<b>{label}</b>" if "/" not in sl else label, str(ref.n),
                     fmt(ref.base_acc, pct=True) + (" <b>near chance</b>" if ref.near_chance else ""),
                     *(_heat_cell(by[v.variant].get(sl)) for v in variants)])
    return ("<h2>Deltas by slice</h2><p class='small muted'>Variant − baseline accuracy in points per suite and "
            "per slice of it (category, context length, depth, prompt-length bucket); "
            "* significant (95% CI excludes 0, or Holm-adjusted McNemar p &lt; 0.05 across all of the variant's "
            "slices); (c→w↓ / w→c↑ flips). Slices whose baseline CI reaches chance cannot show damage. "
            "Small slices have wide intervals: read the n.</p>"
            + table(["slice", "n", "baseline", *(escape(v.variant) for v in variants)], rows, left=1))


def drift_section(run: Run) -> str:
    variants = run.signoff.variants if run.signoff else []
    rows = [[escape(v.variant), str(d.tokens), f"{d.ppl_base:.2f} → {d.ppl_var:.2f}",
             f"{d.ppl_ratio:.4f} [{d.ppl_ratio_ci_low:.4f}, {d.ppl_ratio_ci_high:.4f}]",
             f"{d.kl_mean:.5f} [{d.kl_ci_low:.5f}, {d.kl_ci_high:.5f}]", f"{d.kl_p99:.4f}",
             f"{d.top1_agreement * 100:.2f}% [{d.top1_ci_low * 100:.2f}, {d.top1_ci_high * 100:.2f}]"]
            for v in variants if (d := v.drift)]
    if not rows:
        return ""
    base = run.variants.get("baseline")
    base_drift = base.quality.drift if base and base.quality else None
    corpus = escape(base_drift.corpus) if base_drift else ""
    top_k = variants[0].drift.top_k if variants[0].drift else "k"
    return ("<h2>Token-level drift against the baseline</h2><p class='small muted'>Corpus: " + corpus + ". "
            "From the engine's own logprobs (echo, top-" + str(top_k) + " per position). KL(baseline ‖ "
            "variant) in nats per token over a partition: the tokens both engines list at a position, plus one "
            "bucket for the rest. <b>This is a lower bound of the full-vocabulary KL</b> (merging outcomes never "
            "raises KL), exact when k covers the vocabulary. Top-1: positions where both engines' most likely "
            "next token agree. 95% CIs resample whole windows.</p>"
            + table(["variant", "tokens", "perplexity base → variant", "PPL ratio [95% CI]",
                     "mean KL nats/token [95% CI]", "KL p99", "top-1 agreement [95% CI]"], rows, left=1))


def _flip_row(suite: str, x: dict, y: dict) -> list[str]:
    """One item that flipped: x is the variant's sample, y the baseline's."""
    if "choices" in x and isinstance(x.get("label"), int) and x.get("pred") is not None:
        ch = x["choices"]
        gold, said_b, said_v = ch[x["label"]], ch[y["pred"]], ch[x["pred"]]
    else:  # generation: what each engine wrote, and its failure category
        gold = x.get("target", "")
        said_b = f"[{y.get('category', '')}] {y.get('output', '')}"
        said_v = f"[{x.get('category', '')}] {x.get('output', '')}"
    return [escape(suite), escape(str(x["doc_id"])), escape(str(x["question"])[:300]), escape(str(gold)[:120]),
            escape(said_b[:200]), escape(said_v[:200]), "correct→wrong" if y["correct"] else "wrong→correct"]


def _flipped_rows(run: Run, name: str, limit: int) -> list[list[str]]:
    base_q, var_q = run.variants["baseline"].quality, run.variants[name].quality
    rows = []
    for suite, s in var_q.suites.items():
        if suite not in base_q.suites:
            continue
        b = {y["doc_id"]: y for y in _jsonl(run.run_dir / "baseline" / base_q.suites[suite].samples_file)}
        for x in _jsonl(run.run_dir / name / s.samples_file):
            y = b.get(x["doc_id"])
            if y and y["correct"] != x["correct"] and len(rows) < limit:
                rows.append(_flip_row(suite, x, y))
    return rows


def flips_section(run: Run, limit: int = 15) -> str:
    base = run.variants.get("baseline")
    if not (base and base.quality):
        return ""
    out = []
    for name, v in run.variants.items():
        if name == "baseline" or not v.quality:
            continue
        rows = _flipped_rows(run, name, limit)
        if rows:
            out.append(f"<h3>{escape(name)}</h3>" + table(
                ["suite", "item", "question", "gold", "baseline answer", "variant answer", "flip"], rows, left=7))
    if not out:
        return ""
    return "<h2>Flipped items (first 15 per variant)</h2>" + "".join(out)


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
