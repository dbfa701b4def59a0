"""Every gate's metric x scope checked against what the recipe will measure, before a run.

Sign-off can only judge a gate whose metric and scope exist in the results: a scope that names
no suite, a slice dimension the suite does not have, a slice value it never produces, or an item
metric on the drift corpus would end as N/A -> FAIL after the whole run. Builtin suites' slices are
known before a run (pipeline/suitetable.py; values from the recipe and the extractors); a user's
task declares its slices in its data (each doc's `slices`), read from its local files
(suites.user_slices) where that can be known without lm-eval.
"""

from __future__ import annotations

from pipeline import suites, suitetable
from pipeline.measure import metrics
from pipeline.setup.standard_suites import MMLU_SUBJECT

# the slices of the standard set and the safety suite take fixed values (pipeline/setup/standard_suites.py)
FIXED_SLICES = {
    ("mmlu", "category"): ("humanities", "stem", "social_sciences", "other"),
    ("hellaswag", "source"): ("activitynet", "wikihow"),
    ("hellaswag", "split_type"): ("indomain", "zeroshot"),
    ("harmbench", "category"): ("chemical_biological", "cybercrime_intrusion", "harassment_bullying", "harmful",
                                "illegal", "misinformation_disinformation"),
    ("harmbench", "kind"): ("standard", "contextual"),
    ("mmlu", "subject"): tuple(MMLU_SUBJECT),
}


def slice_values(recipe, suite: str, dim: str) -> set[str] | None:
    """The values a builtin suite's slice dimension takes in this recipe; None: not known before a run."""
    if dim == "prompt_len":
        edges = (0, *suites.BUCKETS)
        return {f"{lo}-{hi - 1} tok" for lo, hi in zip(edges, edges[1:], strict=False)} | {f">={edges[-1]} tok"}
    if suite == "needle" and dim == "context":
        return {f"{n} tok" for n in recipe.quality.needle.context_tokens}
    if suite == "needle" and dim == "depth":
        return {f"{int(d * 100)}%" for d in recipe.quality.needle.depths}
    if (suite, dim) in FIXED_SLICES:
        return set(FIXED_SLICES[suite, dim])
    if suite == "bfcl" and dim == "category":
        return {"simple", "multiple", "irrelevance"}
    return None


def scope_problem(recipe, metric: str, scope: str, task_names: list[str],
                  user: dict[str, dict[str, set[str]] | None] | None = None) -> str | None:
    """Why sign-off could not judge this gate, or None. `user`: each user task's slices from its data
    (None for a task whose slices cannot be known before the run)."""
    m = metrics.METRICS[metric]
    if scope in ("overall", "each_suite"):
        return None
    suite, _, sl = scope.partition("/")
    if suite not in task_names:
        return f"{scope!r} is not a suite this recipe runs ({', '.join(task_names)})"
    if m.needs == "items" and suite == "drift":
        return f"{metric} is judged on scored items; drift has none (gate it with kl_divergence, top1_agreement or " \
               "perplexity_ratio, scope overall)"
    if not sl:
        return None
    dim, eq, value = sl.partition("=")
    if suite not in suitetable.SUITES:
        return _user_scope_problem(recipe, scope, suite, dim, eq, value, (user or {}).get(suite))
    dims = suitetable.SUITES[suite].slices
    if not eq or dim not in dims:
        return f"{scope!r}: {suite} is sliced by {', '.join(dims) or 'nothing'} (scope suite/dimension=value)"
    if dim == "prompt_len":
        return _prompt_len_problem(recipe, scope, suite, value)
    values = slice_values(recipe, suite, dim)
    if values is not None and value not in values:
        return f"{scope!r}: {suite}/{dim} takes the values {', '.join(sorted(values))}"
    return None


def _user_scope_problem(recipe, scope: str, suite: str, dim: str, eq: str, value: str,
                        data: dict[str, set[str]] | None) -> str | None:
    """A user task's slice: prompt_len as for any suite; the rest from the slices its items carry."""
    if dim == "prompt_len" and eq:
        return _prompt_len_problem(recipe, scope, suite, value)
    if data is None:
        return None  # not knowable before the run: sign-off names it if it is empty
    if not eq or dim not in data:
        return f"{scope!r}: {suite}'s items carry the slices {', '.join(sorted(data)) or 'none'} (scope " \
               "suite/dimension=value; each doc's `slices` mapping)"
    if value not in data[dim]:
        shown = sorted(data[dim])
        return f"{scope!r}: no item of {suite} has {dim}={value} (its data has {', '.join(shown[:12])}" \
               + (f" and {len(shown) - 12} more" if len(shown) > 12 else "") + ")"
    return None


def _prompt_len_problem(recipe, scope: str, suite: str, value: str) -> str | None:
    values = slice_values(recipe, suite, "prompt_len")
    if value not in values:
        return f"{scope!r}: {suite}/prompt_len takes the values {', '.join(sorted(values))}"
    if _bucket_floor(value) >= recipe.engine.max_model_len:
        return (f"{scope!r} can never hold an item: its prompts are {value.replace(' tok', '')} tokens long, and "
                f"engine.max_model_len is {recipe.engine.max_model_len}")
    return None


def _bucket_floor(value: str) -> int:
    """The fewest prompt tokens of a prompt_len bucket ('128-255 tok' -> 128, '>=4096 tok' -> 4096)."""
    return int(value.removeprefix(">=").split("-")[0].split()[0])
