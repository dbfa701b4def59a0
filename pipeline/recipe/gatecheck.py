"""Every gate's metric x scope checked against what the recipe will measure, before a run.

Sign-off can only judge a gate whose metric and scope exist in the results: a scope that names
no suite, a slice dimension the suite does not have, a slice value it never produces, or an item
metric on the drift corpus would end as N/A -> FAIL after the whole run. Builtin suites' slices are
known before a run (pipeline/suitetable.py; values from the recipe and the extractors); a user's
task YAML declares its slices only in its data, so those are checked at sign-off.
"""

from __future__ import annotations

from pipeline import suites, suitetable
from pipeline.measure import metrics


def slice_values(recipe, suite: str, dim: str) -> set[str] | None:
    """The values a builtin suite's slice dimension takes in this recipe; None: not known before a run."""
    if dim == "prompt_len":
        edges = (0, *suites.BUCKETS)
        return {f"{lo}-{hi - 1} tok" for lo, hi in zip(edges, edges[1:], strict=False)} | {f">={edges[-1]} tok"}
    if suite == "needle" and dim == "context":
        return {f"{n} tok" for n in recipe.quality.needle.context_tokens}
    if suite == "needle" and dim == "depth":
        return {f"{int(d * 100)}%" for d in recipe.quality.needle.depths}
    if suite == "bigbench" and dim == "category":
        from pipeline.setup.assets import BIGBENCH_TASKS

        return {t.split("/")[0] for t in BIGBENCH_TASKS}
    if suite == "bfcl" and dim == "category":
        return {"simple", "multiple", "irrelevance"}
    return None


def scope_problem(recipe, metric: str, scope: str, task_names: list[str]) -> str | None:
    """Why sign-off could not judge this gate, or None."""
    m = metrics.METRICS[metric]
    if scope in ("overall", "each_suite"):
        return None
    suite, _, sl = scope.partition("/")
    if suite not in task_names:
        return f"{scope!r} is not a suite this recipe runs ({', '.join(task_names)})"
    if m.needs == "items" and suite == "drift":
        return f"{metric} is judged on scored items; drift has none (gate it with kl_divergence, top1_agreement or " \
               "perplexity_ratio, scope overall)"
    if not sl or suite not in suitetable.SUITES:
        return None
    dim, eq, value = sl.partition("=")
    dims = suitetable.SUITES[suite].slices
    if not eq or dim not in dims:
        return f"{scope!r}: {suite} is sliced by {', '.join(dims) or 'nothing'} (scope suite/dimension=value)"
    values = slice_values(recipe, suite, dim)
    if dim == "prompt_len" and value in values and _bucket_floor(value) >= recipe.engine.max_model_len:
        return (f"{scope!r} can never hold an item: its prompts are {value.replace(' tok', '')} tokens long, and "
                f"engine.max_model_len is {recipe.engine.max_model_len}")
    if values is not None and value not in values:
        return f"{scope!r}: {suite}/{dim} takes the values {', '.join(sorted(values))}"
    return None


def _bucket_floor(value: str) -> int:
    """The fewest prompt tokens of a prompt_len bucket ('128-255 tok' -> 128, '>=4096 tok' -> 4096)."""
    return int(value.removeprefix(">=").split("-")[0].split()[0])
