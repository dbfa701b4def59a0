"""Quality of one variant on a running engine: lm-eval suites scored per item, and drift.

lm-eval's local-completions backend talks to the pipeline's vLLM server (loglikelihood from
the engine's echoed prompt logprobs, generation through the chat-templated prompts rendered
into the run's task folder). Every item is kept with its correctness, failure category,
slices and prompt length (samples/<suite>.jsonl); the suite result is summarised from them.
Drift sends each window of the essay corpus once for its logprobs (pipeline/measure/drift.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from collections import Counter
from pathlib import Path

from pipeline import suites, suitetable
from pipeline.engines.interface import Engine
from pipeline.measure import drift, stats
from pipeline.progress import Progress
from pipeline.results import DriftQuality, NoiseFloor, QualityResult, SliceStat, SuiteQuality
from pipeline.runstore import atomic_write_text
from pipeline.setup import assets


class _QuietLmEval:
    """Drops two lm-eval warnings that do not apply here and would read as problems: the engine
    serves batched requests of any lengths ("Batch size > 1 detected"), and generative suites
    carry the model's chat template in their rendered prompts while multiple-choice suites score
    plain text on purpose ("... chat template is not applied")."""

    BENIGN = ("Batch size > 1 detected", "chat template is not applied")

    def filter(self, record) -> bool:
        msg = " ".join(record.getMessage().split())  # lm-eval re-wraps its text
        return not any(b in msg for b in self.BENIGN)


def quiet_lm_eval_warnings() -> None:
    import logging

    for name in ("lm_eval.models.api_models", "lm_eval.evaluator"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _QuietLmEval) for f in lg.filters):
            lg.addFilter(_QuietLmEval())


def run_quality(server: Engine, model_dir: Path, recipe, variant: str, vdir: Path,
                input_hash: str, tasks_dir: Path) -> QualityResult:
    """Every lm-eval suite in as few lm-eval calls as there are distinct limits, then drift."""
    import lm_eval
    from transformers import AutoTokenizer

    quiet_lm_eval_warnings()
    t0 = time.perf_counter()
    q = recipe.quality
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=recipe.model.trust_remote_code)
    refs = suites.resolve(q.suites)
    limit = {r.name: q.limit_of(entry) for entry, r in zip(q.suites, refs, strict=True)}
    lm_refs = [r for r in refs if r.kind != "drift"]
    for r in lm_refs:
        suites.render(r, tasks_dir, tok, q, limit[r.name])
    by_limit = lm_eval_groups(q, refs)
    samples, configs, timings = run_lm_eval(server, model_dir, recipe, by_limit, tasks_dir, variant)
    results, first = {}, {}
    samples_dir = vdir / "samples"
    samples_dir.mkdir(parents=True, exist_ok=True)
    utils = suites.utils_module()
    for r in lm_refs:
        rows, metric = score_items(r, samples[r.task], configs.get(r.task, {}), tok, utils)
        path = samples_dir / f"{r.name}.jsonl"
        text = "".join(json.dumps(x) + "\n" for x in rows)
        atomic_write_text(path, text)
        results[r.name] = suite_quality(r, rows, metric, str(path.relative_to(vdir)),
                                        hashlib.sha256(text.encode()).hexdigest())
        first[r.name] = {x["doc_id"]: x for x in rows}
    noise = {}
    if variant == "baseline" and q.noise_floor and lm_refs:
        noise = noise_floor(server, model_dir, recipe, by_limit, tasks_dir, lm_refs, first, tok, utils, timings)
    drift = None
    if any(r.kind == "drift" for r in refs):
        t1 = time.perf_counter()
        drift = run_drift(server, tok, q.drift, vdir, variant)
        timings["drift"] = round(time.perf_counter() - t1, 1)
    return QualityResult(variant=variant, input_hash=input_hash, status="ok",
                         duration_s=time.perf_counter() - t0, suites=results, noise_floor=noise, drift=drift,
                         lm_eval_version=lm_eval.__version__,
                         settings={"backend": "local-completions (vLLM server, echo+logprobs)",
                                   "limits": {r.name: limit[r.name] for r in lm_refs}, "num_fewshot": 0,
                                   "correct_metric": {"mc": {r.name: suitetable.SUITES[r.name].metric
                                                             for r in lm_refs if r.kind == "mc"},
                                                      "gen": "acc (evalsuites/qe_utils.py)",
                                                      "user": "acc_norm if present, else the task's first metric"
                                                              " == 1"},
                                   "seconds": timings,
                                   "prompt_length_buckets": "prompt tokens by the model's tokenizer, "
                                                            "edges " + ", ".join(map(str, suites.BUCKETS))})


def lm_eval_groups(q, refs: list) -> dict[int | None, list]:
    """The suites (not drift) grouped into one lm-eval call per distinct limit: builtin data is cut when it is
    rendered (key None), a user's task by lm-eval's limit, its own from quality.limits where it has one."""
    out: dict[int | None, list] = {}
    for entry, r in zip(q.suites, refs, strict=True):
        if r.kind != "drift":
            out.setdefault(q.limit_of(entry) if r.kind == "user" else None, []).append(r)
    return out


# the A/A pass: another batch composition than the default's 2 x 8 (other prompts share each engine step), with
# as many requests in flight so the engine is kept as busy as in the first pass
AA_CONCURRENT, AA_BATCH = 4, 3
# It scores the first AA_PROBE items of each suite first. An engine whose numbers do not move with batch
# composition (float32 on CPU: batch-invariant kernels) gives them back bit for bit, and then no item of that
# suite can flip and its other items are not scored again; one number of a suite that moved and every item of
# that suite is scored again. Suite by suite: a kernel can be batch-invariant for short prompts and not for long
# ones, and one suite's movement says nothing of another's.
AA_PROBE = 50


def noise_floor(server: Engine, model_dir: Path, recipe, by_limit: dict, tasks_dir: Path, lm_refs: list,
                first: dict[str, dict[int, dict]], tok, utils, timings: dict) -> dict[str, NoiseFloor]:
    """The baseline's items again, batched otherwise, compared item by item with the first pass (`first`:
    per suite, doc_id -> its row)."""
    first_pass = (recipe.quality.num_concurrent, recipe.quality.batch_size)
    alt = (2, 5) if first_pass == (AA_CONCURRENT, AA_BATCH) else (AA_CONCURRENT, AA_BATCH)
    how = (f"scored again in the same engine, {alt[0]} request(s) in flight with {alt[1]} prompts "
           f"each (first pass: {first_pass[0]} x {first_pass[1]})")

    def again(limit: int | None, label: str, refs: list) -> dict[str, dict[int, dict]]:
        groups = {k: [r for r in v if r in refs] for k, v in by_limit.items()}
        samples, configs, t = run_lm_eval(server, model_dir, recipe, {k: v for k, v in groups.items() if v},
                                          tasks_dir, label, batching=alt, limit=limit)
        timings.update({f"{label} {k}": v for k, v in t.items()})
        return {r.name: {x["doc_id"]: x for x in score_items(r, samples[r.task], configs.get(r.task, {}), tok,
                                                              utils)[0]} for r in refs}

    probe = again(AA_PROBE, "baseline A/A", lm_refs)
    moved = [r for r in lm_refs if not bit_identical(first[r.name], probe[r.name])]
    redo = [r for r in moved if not set(probe[r.name]) >= set(first[r.name])]  # more items than the probe held
    full = {**probe, **(again(None, "baseline A/A, every item", redo) if redo else {})}
    return {r.name: aa_flips(first[r.name], full[r.name], f"every item {how}") if r in moved else
            aa_flips(first[r.name], probe[r.name],
                     f"the first {len(probe[r.name])} items {how}: every number came back bit-identical, so batch "
                     "composition does not move this engine's numbers on this suite and no item can flip; the "
                     "other items were not scored again") for r in lm_refs}


def _numbers(row: dict):
    """What the engine computed for an item: its choices' log-likelihoods, or its generated text."""
    return row.get("loglikelihoods", row.get("output"))


def bit_identical(first: dict[int, dict], again: dict[int, dict]) -> bool:
    """Every item scored again (doc_id -> row) came back with exactly the first pass's numbers."""
    return bool(again) and all(i in first and _numbers(first[i]) == _numbers(row) for i, row in again.items())


def aa_flips(first: dict[int, dict], again: dict[int, dict], how: str) -> NoiseFloor:
    """Items (doc_id -> row) of two passes of one engine: the flips between them, both ways."""
    ids = sorted(set(first) & set(again))
    return NoiseFloor(n=len(ids), how=how, identical=bit_identical(first, again),
                      flips_correct_to_wrong=sum(1 for i in ids if first[i]["correct"] and not again[i]["correct"]),
                      flips_wrong_to_correct=sum(1 for i in ids if again[i]["correct"] and not first[i]["correct"]))


def expected_prompts(tasks_dir: Path, group: list, limit: int | None = None) -> int | None:
    """Prompts the engine will score for these suites (a continuation per choice, one generation per
    item) of their first `limit` items; None when a user's task is among them (lm-eval's to count)."""
    total = 0
    for r in group:
        data = tasks_dir / f"qe_{r.name}.jsonl"
        if r.kind == "user" or not data.exists():
            return None
        rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()][:limit]
        total += sum(len(x.get("choices") or [None]) if r.kind == "mc" else 1 for x in rows)
    return total


def run_lm_eval(server: Engine, model_dir: Path, recipe, by_limit: dict, tasks_dir: Path, label: str,
                batching: tuple[int, int] | None = None, limit: int | None = None):
    """One lm-eval call per distinct limit; progress from the engine's own count of finished requests.
    `batching`: (requests in flight, prompts a request) instead of the recipe's; `limit`: only the first
    items of every suite (the A/A probe)."""
    import threading

    import lm_eval
    import lm_eval.evaluator
    from lm_eval.tasks import TaskManager

    # lm-eval records the git commit of the working folder; outside a repository git prints "fatal: not a
    # git repository" through --quiet, and the run's provenance already records what was measured
    lm_eval.evaluator.get_git_commit_hash = lambda: None
    samples, configs, timings = {}, {}, {}
    if not by_limit:
        return samples, configs, timings
    tm = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    model_args = lm_eval_model_args(server, model_dir, recipe)
    if batching:
        model_args.update(num_concurrent=batching[0], batch_size=batching[1])
    for lim, group in by_limit.items():
        if limit is not None:
            lim = limit if lim is None else min(lim, limit)
        t1, done = time.perf_counter(), threading.Event()
        bar = Progress("quality: " + ", ".join(r.name for r in group), expected_prompts(tasks_dir, group, lim),
                       "prompts scored", label)
        start = server.gauges()["finished"]

        def poll(bar=bar, start=start, done=done) -> None:
            while not done.wait(2.0):
                try:
                    bar.update(int(server.gauges()["finished"] - start))
                except OSError:
                    pass

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            out = lm_eval.simple_evaluate(
                model=local_completions(model_args), tasks=[r.task for r in group],
                task_manager=tm, limit=lim, log_samples=True, random_seed=0, numpy_random_seed=0,
                torch_random_seed=0, fewshot_random_seed=0)
        finally:
            done.set()
            poller.join()
            bar.close()
        timings["lm_eval: " + ", ".join(r.name for r in group)] = round(time.perf_counter() - t1, 1)
        samples.update(out["samples"])
        configs.update(out["configs"])
    return samples, configs, timings




def local_completions(model_args: dict):
    """lm-eval's local-completions model, built as `simple_evaluate(model="local-completions",
    model_args=...)` builds it, less its "Tokenizing inputs" bar: lm-eval passes that bar
    disable=False explicitly, which tqdm lets win over TQDM_DISABLE, so it printed through --quiet
    and into CI logs where the stage's own progress line already counts the prompts."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    class Quiet(LocalCompletionsAPI):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=True)

    return Quiet.create_from_arg_obj(model_args)


def lm_eval_model_args(server: Engine, model_dir: Path, recipe) -> dict:
    """lm-eval's local-completions against the pipeline's server; the fidelity test gives the
    lm_eval CLI exactly these. Requests start with <bos> where the model's tokenizer puts one."""
    q = recipe.quality
    return dict(model=server.served_name, base_url=server.base_url + "/v1/completions",
                tokenizer=str(model_dir), tokenizer_backend="huggingface",
                tokenized_requests=True, num_concurrent=q.num_concurrent, batch_size=q.batch_size,
                max_retries=2, max_length=recipe.engine.max_model_len, timeout=600,
                add_bos_token=_adds_bos(str(model_dir), recipe.model.trust_remote_code))


@functools.lru_cache(maxsize=8)
def _adds_bos(model_dir: str, trust_remote_code: bool) -> bool:
    from transformers import AutoTokenizer

    return suites.bos_prefix(AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)) is not None


def _first(x):
    while isinstance(x, (list, tuple)) and x:
        x = x[0]
    return x


def score_items(suite, samples: list[dict], config: dict, tok, utils) -> tuple[list[dict], str]:
    """Per-item rows (kept for audit): correct or not, failure category, slices, prompt length."""
    rows = []
    output_type = config.get("output_type") or ("multiple_choice" if suite.kind == "mc" else "generate_until")
    metric = suitetable.SUITES[suite.name].metric if suite.kind == "mc" else "acc"
    if suite.kind == "user":
        names = [m["metric"] for m in config.get("metric_list", []) if isinstance(m, dict) and "metric" in m]
        metric = "acc_norm" if "acc_norm" in names else (names[0] if names else "acc")
    gen = config.get("generation_kwargs") or {}
    max_gen = int(gen.get("max_gen_toks", 256))
    seen = set()
    for s in samples:
        if s["doc_id"] in seen:  # a task with several filters logs one sample per filter: keep the first
            continue
        seen.add(s["doc_id"])
        doc = s["doc"]
        context = _first(s["arguments"])
        n_prompt = len(tok(str(context), add_special_tokens=False)["input_ids"])
        slices = {**(doc.get("slices") or {}), "prompt_len": suites.bucket(n_prompt)}
        correct = int(float(s.get(metric, 0)) >= 1.0)
        row = {"doc_id": int(s["doc_id"]), "id": doc.get("id", s["doc_id"]),
               "question": doc.get("question") or str(context)[-2000:], "target": str(s.get("target")),
               "correct": correct, "prompt_tokens": n_prompt, "slices": slices,
               "doc_hash": s.get("doc_hash"), "prompt_hash": s.get("prompt_hash")}
        if output_type == "multiple_choice":
            lls = [float(_first(r)) for r in s["filtered_resps"]]
            choices = doc.get("choices") or [str(a[1]) for a in s["arguments"]]
            row.update(choices=choices, label=doc.get("label", s.get("target")), loglikelihoods=lls,
                       pred=_pick(lls, choices, metric) if len(choices) == len(lls) else None,
                       acc=int(float(s.get("acc", 0)) >= 1.0), chance=1 / max(1, len(lls)),
                       category="correct" if correct else "wrong")
        else:
            text = str(_first(s["filtered_resps"]) or "")
            # the engine generated at most max_gen tokens; re-encoding its text can count more (a random or
            # byte-level model's pieces do not round-trip), so the count is capped at what was possible
            n_out = min(len(tok(text, add_special_tokens=False)["input_ids"]), max_gen)
            if "strict_match" in s:  # gsm8k: lm-eval's strict-match beside its flexible-extract `correct`
                row["strict_match"] = int(float(s["strict_match"]) >= 1.0)
            row.update(output=text, output_tokens=n_out, chance=0.0,
                       category=utils.failure_category(suite.name, doc, text, bool(correct), n_out, max_gen))
            if suite.kind == "gen":
                row["question"] = doc.get("question") or doc.get("needle_answer", "")
        rows.append(row)
    rows.sort(key=lambda r: r["doc_id"])
    if not rows:
        raise ValueError(f"suite {suite.name}: lm-eval returned no items")
    return rows, metric


def _pick(lls: list[float], choices: list[str], metric: str) -> int:
    """The choice the suite's metric scored: the plain argmax for acc (Winogrande's options fill a blank and
    score one shared continuation, so dividing by an option's length would pick another answer), else
    acc_norm's."""
    if metric != "acc_norm":
        return max(range(len(lls)), key=lls.__getitem__)
    return _argmax_norm(lls, choices)


def _argmax_norm(lls: list[float], choices: list[str]) -> int:
    """lm-eval's acc_norm choice (api/task.py): loglikelihood / len(choice) in characters."""
    normed = [ll / max(1, len(str(c))) for ll, c in zip(lls, choices, strict=True)]
    return max(range(len(normed)), key=normed.__getitem__)


def suite_quality(suite, rows: list[dict], metric: str, samples_file: str, sha: str) -> SuiteQuality:
    k, n = sum(r["correct"] for r in rows), len(rows)
    lo, hi = stats.wilson(k, n)
    chance = sum(r["chance"] for r in rows) / n if n else 0.0
    cats: dict[str, int] = {}
    groups: dict[str, list[dict]] = {}
    for r in rows:
        cats[r["category"]] = cats.get(r["category"], 0) + 1
        for dim, val in r["slices"].items():
            groups.setdefault(f"{dim}={val}", []).append(r)
    slices = {}
    for key, rs in sorted(groups.items()):
        kk, nn = sum(r["correct"] for r in rs), len(rs)
        a, b = stats.wilson(kk, nn)
        slices[key] = SliceStat(n=nn, correct=kk, accuracy=kk / nn, ci_low=a, ci_high=b,
                                chance=sum(r["chance"] for r in rs) / nn)
    return SuiteQuality(suite=suite.name, n=n, correct=k, accuracy=k / n if n else math.nan, ci_low=lo, ci_high=hi,
                        chance=chance, near_chance=lo <= chance, metric=metric, kind=suite.kind,
                        pooled=suite.kind == "user" or suitetable.SUITES[suite.name].pooled,
                        categories=cats, slices=slices, samples_file=samples_file, samples_sha256=sha)


def drift_windows(tok, spec) -> list[dict]:
    """The drift suite's windows: `spec.windows` from the last essays (a few from each, drift.spread_spans),
    then `spec.code_windows` of HumanEval's code (a second text domain); each {"ids", "domain", "doc"}, doc
    being the document most of its tokens come from (the search signs off on documents it never read), or the
    window itself where the tokenizer gives no offsets."""
    out = []
    for domain, count in (("essays", spec.windows), ("code", spec.code_windows)):
        if not count:
            continue
        ids, docs = suites.corpus(tok, domain)
        try:  # code: problems shorter than a window, all sealed in a search: consecutive windows
            spans = (drift.spread_spans(docs, len(ids), count, spec.window_tokens) if domain == "essays"
                     else drift.window_spans(len(ids), count, spec.window_tokens))
        except ValueError as exc:
            raise ValueError(f"quality.drift: {exc}" + (" (code_windows, HumanEval)" if domain == "code" else "")
                             ) from None
        bos = suites.bos_prefix(tok)
        for a, b in spans:
            doc = Counter(docs[a:b]).most_common(1)[0][0] if docs else f"{domain}/window-{len(out)}"
            out.append({"ids": ids[a:b] if bos is None else [bos] + ids[a + 1:b], "domain": domain, "doc": doc})
    return out


def run_drift(server: Engine, tok, spec, vdir: Path, label: str = "") -> DriftQuality:
    windows = drift_windows(tok, spec)
    with Progress("drift", len(windows), "windows", label) as bar:
        rows = drift.score_windows(server.port, server.served_name, [w["ids"] for w in windows], spec.top_k,
                                   on_done=bar.advance)
    for r, w in zip(rows, windows, strict=True):
        r.update(domain=w["domain"], doc=w["doc"])
    path = vdir / "samples" / "drift.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows)
    atomic_write_text(path, text)
    prose = [r for r in rows if r["domain"] == "essays"]
    ppl, tokens = drift.perplexity(prose)
    code = f"; {spec.code_windows} x {spec.window_tokens} tokens of {assets.HUMANEVAL.name}=={assets.HUMANEVAL.version} " \
           "code scored apart" if spec.code_windows else ""
    return DriftQuality(windows=len(prose), tokens=tokens, window_tokens=spec.window_tokens, top_k=spec.top_k,
                        perplexity=ppl, corpus=f"{assets.NEEDLE.name}=={assets.NEEDLE.version} essays, "
                        f"{len(prose)} x {spec.window_tokens} tokens from the last "
                        f"{len({r['doc'] for r in prose})} ({drift.PER_DOC} at most from each){code}",
                        code_windows=len(rows) - len(prose),
                        samples_file=str(path.relative_to(vdir)),
                        samples_sha256=hashlib.sha256(text.encode()).hexdigest())


def summary(q: QualityResult) -> str:
    """The stage's console line."""
    aa = (f"engine vs itself (A/A): {sum(x.flips for x in q.noise_floor.values())} of "
          f"{sum(x.n for x in q.noise_floor.values())} items flipped"
          + (", every number bit-identical" if all(x.identical for x in q.noise_floor.values()) else "")
          ) if q.noise_floor else ""
    return ", ".join([f"{s} {r.accuracy:.3f} (n={r.n})" for s, r in q.suites.items()]
                     + ([f"drift PPL {q.drift.perplexity:.2f} ({q.drift.tokens} tokens)"] if q.drift else [])
                     + ([aa] if aa else []))
