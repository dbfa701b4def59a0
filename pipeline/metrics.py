"""The metrics a gate may name: one place that says what each means and where it comes from.

A metric is computed from one variant's results and the baseline's. Metrics with a
confidence interval are gated on its conservative end (see pipeline/stages/signoff.py),
so a gate on a few hundred items cannot pass on luck.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    stage: str  # the result file it is read from
    unit: str
    description: str
    sliced: bool = False  # per suite as well as overall
    higher_is_better: bool = True
    needs: str | None = None  # items: a scored suite; drift: the drift suite


METRICS: dict[str, Metric] = {
    "accuracy": Metric("quality", "fraction", "Variant accuracy, 95% Wilson CI.", sliced=True, needs="items"),
    "accuracy_delta": Metric(
        "quality", "fraction",
        "Variant minus baseline accuracy on the same items, 95% paired-bootstrap CI. "
        "A non-inferiority gate is `accuracy_delta >= -margin`, judged on the CI's lower bound. Scope may "
        "also name one slice, e.g. `bigbench/category=navigate` or `needle/context=1024 tok`.",
        sliced=True, needs="items"),
    "kl_divergence": Metric(
        "quality", "nats/token", "Mean token-level KL(baseline || variant) of next-token distributions on the drift "
        "corpus, 95% bootstrap CI over windows; a lower bound of the full-vocabulary KL (top-k partition).",
        higher_is_better=False, needs="drift"),
    "top1_agreement": Metric(
        "quality", "fraction", "Positions of the drift corpus where the variant's most likely next token is the "
        "baseline's, 95% bootstrap CI over windows.", needs="drift"),
    "perplexity_ratio": Metric(
        "quality", "ratio", "Drift-corpus perplexity, variant / baseline, 95% bootstrap CI over windows.",
        higher_is_better=False, needs="drift"),
    "ttft_p50_ratio": Metric("systems", "ratio", "p50 TTFT, variant / baseline.", higher_is_better=False),
    "ttft_p99_ratio": Metric("systems", "ratio", "p99 TTFT, variant / baseline.", higher_is_better=False),
    "tpot_p50_ratio": Metric("systems", "ratio", "p50 TPOT, variant / baseline.", higher_is_better=False),
    "tpot_p99_ratio": Metric("systems", "ratio", "p99 TPOT, variant / baseline.", higher_is_better=False),
    "ttft_p99_ms": Metric("systems", "ms", "p99 time to first token (absolute SLO).", higher_is_better=False),
    "tpot_p99_ms": Metric("systems", "ms", "p99 time per output token (absolute SLO).", higher_is_better=False),
    "error_rate": Metric("systems", "fraction", "Failed or timed-out requests / all.", higher_is_better=False),
    "checkpoint_bytes_ratio": Metric(
        "systems", "ratio", "Checkpoint bytes on disk, variant / baseline.", higher_is_better=False),
    "peak_memory_ratio": Metric(
        "systems", "ratio", "Peak engine memory, variant / baseline.", higher_is_better=False),
    "kv_tokens_ratio": Metric("systems", "ratio", "KV-cache capacity in tokens, variant / baseline."),
}
