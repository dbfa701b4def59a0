"""The engine-agreement check: a sample of every suite's items scored again by a second, independent engine.

The serving engine's numbers are the ones a release is signed on; nothing else in a run says they are what
the scheme computes. A wrong kernel, a packing bug or a scale read from the wrong tensor moves every answer
and still yields a plausible accuracy. So the reference engine (pipeline/engines/transformers: transformers
and compressed-tensors, one prompt per forward pass) loads the checkpoint the variant was *built* as (for an
emulated variant, the compressed checkpoint, not the pipeline's own dequantized copy the serving engine
loaded), scores the first `quality.agreement_sample` items of each suite, and the two are compared item by
item: the answer chosen (or the text generated) and every choice's log-likelihood. Both engines compute in
the engine dtype, so their log-likelihoods differ by rounding only; a relative difference above what that
dtype explains (TOLERANCE) flags the variant in the report's first table.

What the reference cannot reproduce is skipped with the reason (an FP8 KV cache, weights quantized by the
serving engine as it loads them, legacy GPTQ/AWQ-format checkpoints).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from pipeline import suites
from pipeline.engines import interface
from pipeline.engines.interface import Launch
from pipeline.results import AgreementResult, SuiteAgreement
from pipeline.runstore import hash_obj, read_result, write_json
from pipeline.stages import quality
from pipeline.store import keys

# the largest relative log-likelihood difference (|a - b| / max(1, |a|)) two engines computing the same model
# in this dtype can show from rounding alone: float32 sums in another order differ in the sixth digit; the
# 16-bit types round every activation to 8 (bfloat16) or 11 (float16) bits
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
REFERENCE = "transformers"


def unsupported(weights: Path, kv_cache_dtype: str, load_quantization: str | None) -> str | None:
    """Why the reference engine cannot compute what the serving engine was asked to (None: it can)."""
    if kv_cache_dtype != "auto":
        return "the reference engine keeps its KV cache in the engine dtype, not FP8"
    if load_quantization:
        return f"weights quantized by the serving engine as it loads them ({load_quantization})"
    qc = json.loads((weights / "config.json").read_text()).get("quantization_config") or {}
    if qc and qc.get("quant_method") != "compressed-tensors":
        return f"{qc.get('quant_method')}-format checkpoints need a kernel package the reference engine lacks"
    return None


def key(quality_key: str, weights: Path, sample: int) -> str:
    return hash_obj({"quality": quality_key, "reference_weights": str(weights), "sample": sample,
                     "code": keys.source_hash(*AGREEMENT_CODE)})


def check(recipe, variant: str, vdir: Path, tasks_dir: Path, weights: Path, tokenizer: Path | None, dtype: str,
          quality_key: str, skip: str | None, log=print) -> AgreementResult | None:
    """The check for one variant whose quality was measured into vdir; reused when its inputs are unchanged.
    Never raises: a reference engine that fails is recorded as a failed check, the variant's results stand."""
    n = recipe.quality.agreement_sample
    by_limit = quality.lm_eval_groups(recipe.quality, suites.resolve(recipe.quality.suites))
    lm_refs = [r for group in by_limit.values() for r in group]
    if n == 0 or not lm_refs:
        return None
    h = key(quality_key, weights, n)
    path = vdir / "agreement.json"
    if (done := read_result(path, AgreementResult, h)) is not None and done.status != "failed":
        return done
    base = dict(variant=variant, input_hash=h, reference=REFERENCE, dtype=dtype, sample=n,
                loaded=str(weights), tolerance_rel=TOLERANCE.get(dtype))
    if skip:
        r = AgreementResult(**base, status="skipped", duration_s=0.0, error=skip)
        log(f"engine agreement: not checked ({skip})")
    else:
        t0 = time.perf_counter()
        try:
            r = _check(recipe, variant, vdir, tasks_dir, weights, tokenizer, dtype, by_limit, base, log)
        except Exception as exc:  # the serving engine's results stand; the report says the check failed
            r = AgreementResult(**base, status="failed", duration_s=time.perf_counter() - t0,
                                error=f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
            log(f"engine agreement: FAILED to check ({r.error})")
    write_json(path, r)
    return r


def _check(recipe, variant, vdir, tasks_dir, weights, tokenizer, dtype, by_limit, base, log) -> AgreementResult:
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    tok_dir = tokenizer or weights
    tok = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=recipe.model.trust_remote_code)
    lm_refs = [r for group in by_limit.values() for r in group]
    served = {r.name: {x["doc_id"]: x for x in map(json.loads, (vdir / "samples" / f"{r.name}.jsonl").read_text()
                                                     .splitlines())} for r in lm_refs}
    spec = Launch(weights, recipe.engine, dtype, vdir / "reference.log", recipe.model.trust_remote_code,
                  tokenizer=tokenizer, say=log)
    log(f"engine agreement: scoring the first {base['sample']} items of each suite in the reference engine")
    with interface.kind(REFERENCE).launch(spec) as ref, ref.blamed_for_errors():
        log(f"reference engine ready in {ref.start_s:.0f} s")
        samples, configs, _ = quality.run_lm_eval(ref, tok_dir, recipe, by_limit, tasks_dir, f"{variant} reference",
                                                  limit=base["sample"])
    utils = suites.utils_module()
    out = {r.name: compare(served[r.name], quality.score_items(r, samples[r.task], configs.get(r.task, {}), tok,
                                                               utils)[0]) for r in lm_refs}
    res = AgreementResult(**base, status="ok", duration_s=time.perf_counter() - t0, suites=out)
    res.flagged, res.reason = verdict(out, base["tolerance_rel"], dtype)
    log("engine agreement: " + summary(res))
    return res


def compare(served: dict[int, dict], reference: list[dict]) -> SuiteAgreement:
    """The reference's rows against the serving engine's, item by item (doc_id)."""
    same, diffs, worst = 0, [], (None, -1.0)
    for row in reference:
        s = served.get(row["doc_id"])
        if s is None:
            raise ValueError(f"item {row['doc_id']} was scored by the reference engine but not by the serving one")
        if "loglikelihoods" in row:
            same += int(s.get("pred") == row.get("pred"))
            for a, b in zip(s["loglikelihoods"], row["loglikelihoods"], strict=True):
                d = abs(a - b) / max(1.0, abs(a))
                diffs.append(d)
                if d > worst[1]:
                    worst = (row["doc_id"], d)
        else:
            same += int(s.get("output") == row.get("output"))
    return SuiteAgreement(n=len(reference), same_answer=same, max_rel_diff=max(diffs) if diffs else None,
                          median_rel_diff=statistics.median(diffs) if diffs else None, worst_doc_id=worst[0])


def verdict(by_suite: dict[str, SuiteAgreement], tolerance: float | None, dtype: str) -> tuple[bool, str]:
    """Flagged when any log-likelihood differs by more than the dtype explains. A different answer alone is
    not flagged: two choices within rounding of each other can swap under any two engines."""
    worst = max(((s.max_rel_diff, name) for name, s in by_suite.items() if s.max_rel_diff is not None),
                default=None)
    if tolerance is None or worst is None:
        return False, f"no tolerance known for {dtype}" if tolerance is None else "no log-likelihoods compared"
    if worst[0] > tolerance:
        return True, (f"log-likelihoods differ by up to {worst[0]:.2g} (relative, {worst[1]}), above the "
                      f"{tolerance:g} that {dtype} rounding explains: the engines do not compute the same model")
    return False, f"log-likelihoods within {worst[0]:.2g} (relative; {dtype} explains up to {tolerance:g})"


def summary(r: AgreementResult) -> str:
    if r.status != "ok":
        return f"{r.status}: {r.error}"
    n = sum(s.n for s in r.suites.values())
    same = sum(s.same_answer for s in r.suites.values())
    return f"{same}/{n} same answers; " + ("DISAGREE: " if r.flagged else "") + r.reason


AGREEMENT_CODE = keys.import_closure(Path(__file__), *keys.QUALITY_CODE,
                                     *(keys.PIPELINE / "engines" / REFERENCE).glob("*.py"))
