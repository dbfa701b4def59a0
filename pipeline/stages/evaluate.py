"""Quality and systems measurement of one variant from a single engine start.

Starting vLLM costs 30-90 s here; measuring quality and latency by hand pays it twice.
One server per variant serves lm-eval (local-completions, loglikelihood from the
engine's echoed prompt logprobs) and then the latency workload. Quality runs first so
its requests warm nothing the latency cell measures: latency prompts are distinct text.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

from pipeline import assets, drift, stats, suites
from pipeline.engines import loadgen
from pipeline.engines.server import SERVED_NAME, Server
from pipeline.results import (
    AdmissionProbe,
    CellResult,
    DriftQuality,
    KVCapacity,
    Latency,
    QualityResult,
    RampStep,
    Roofline,
    SliceStat,
    SuiteQuality,
    SystemsResult,
)
from pipeline.runstore import atomic_write_text, weight_bytes, write_json

CORRECT_METRIC = "acc_norm"  # multiple choice: length-normalised loglikelihood argmax


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


def run_quality(server: Server, model_dir: Path, recipe, variant: str, vdir: Path,
                input_hash: str, tasks_dir: Path) -> QualityResult:
    """Every lm-eval suite in as few lm-eval calls as there are distinct limits, then drift."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    quiet_lm_eval_warnings()
    t0 = time.perf_counter()
    q = recipe.quality
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=recipe.model.trust_remote_code)
    refs = suites.resolve(q.suites)
    limit = {r.name: q.limit_of(entry) for entry, r in zip(q.suites, refs, strict=True)}
    lm_refs = [r for r in refs if r.kind != "drift"]
    by_limit: dict[int | None, list] = {}
    for r in lm_refs:  # builtin data is cut when rendered; a user's task is cut by lm-eval's limit
        suites.render(r, tasks_dir, tok, q, limit[r.name])
        by_limit.setdefault(limit[r.name] if r.kind == "user" else None, []).append(r)
    samples, configs, timings = {}, {}, {}
    if lm_refs:
        tm = TaskManager(include_path=str(tasks_dir), include_defaults=False)
        model_args = lm_eval_model_args(server, model_dir, recipe)
        for lim, group in by_limit.items():
            t1 = time.perf_counter()
            out = lm_eval.simple_evaluate(
                model="local-completions", model_args=model_args, tasks=[r.task for r in group],
                task_manager=tm, limit=lim, log_samples=True, random_seed=0, numpy_random_seed=0,
                torch_random_seed=0, fewshot_random_seed=0)
            timings["lm_eval: " + ", ".join(r.name for r in group)] = round(time.perf_counter() - t1, 1)
            samples.update(out["samples"])
            configs.update(out["configs"])
    results = {}
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
    drift = None
    if any(r.kind == "drift" for r in refs):
        t1 = time.perf_counter()
        drift = run_drift(server, tok, q.drift, vdir)
        timings["drift"] = round(time.perf_counter() - t1, 1)
    return QualityResult(variant=variant, input_hash=input_hash, status="ok",
                         duration_s=time.perf_counter() - t0, suites=results, drift=drift,
                         lm_eval_version=lm_eval.__version__,
                         settings={"backend": "local-completions (vLLM server, echo+logprobs)",
                                   "limits": {r.name: limit[r.name] for r in lm_refs}, "num_fewshot": 0,
                                   "correct_metric": {"mc": CORRECT_METRIC, "gen": "acc (evalsuites/qe_utils.py)",
                                                      "user": "acc_norm if present, else the task's first metric"
                                                              " == 1"},
                                   "seconds": timings,
                                   "prompt_length_buckets": "prompt tokens by the model's tokenizer, "
                                                            "edges " + ", ".join(map(str, suites.BUCKETS))})


def lm_eval_model_args(server: Server, model_dir: Path, recipe) -> dict:
    """lm-eval's local-completions against the pipeline's server; the fidelity test gives the
    lm_eval CLI exactly these."""
    q = recipe.quality
    return dict(model=SERVED_NAME, base_url=server.base_url + "/v1/completions",
                tokenizer=str(model_dir), tokenizer_backend="huggingface",
                tokenized_requests=True, num_concurrent=q.num_concurrent, batch_size=q.batch_size,
                max_retries=2, max_length=recipe.engine.max_model_len, timeout=600)


def _first(x):
    while isinstance(x, (list, tuple)) and x:
        x = x[0]
    return x


def score_items(suite, samples: list[dict], config: dict, tok, utils) -> tuple[list[dict], str]:
    """Per-item rows (kept for audit): correct or not, failure category, slices, prompt length."""
    rows = []
    output_type = config.get("output_type") or ("multiple_choice" if suite.kind == "mc" else "generate_until")
    metric = CORRECT_METRIC if suite.kind == "mc" else "acc"
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
                       pred=_argmax_norm(lls, choices) if len(choices) == len(lls) else None,
                       acc=int(float(s.get("acc", 0)) >= 1.0), chance=1 / max(1, len(lls)),
                       category="correct" if correct else "wrong")
        else:
            text = str(_first(s["filtered_resps"]) or "")
            n_out = len(tok(text, add_special_tokens=False)["input_ids"])
            row.update(output=text, output_tokens=n_out, chance=0.0,
                       category=utils.failure_category(suite.name, doc, text, bool(correct), n_out, max_gen))
            if suite.kind == "gen":
                row["question"] = doc.get("question") or doc.get("needle_answer", "")
        rows.append(row)
    rows.sort(key=lambda r: r["doc_id"])
    if not rows:
        raise ValueError(f"suite {suite.name}: lm-eval returned no items")
    return rows, metric


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
                        categories=cats, slices=slices, samples_file=samples_file, samples_sha256=sha)


def run_drift(server: Server, tok, spec, vdir: Path) -> DriftQuality:
    windows = drift.windows_from_ids(suites.essay_ids(tok), spec.windows, spec.window_tokens)
    rows = drift.score_windows(server.port, SERVED_NAME, windows, spec.top_k)
    path = vdir / "samples" / "drift.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows)
    atomic_write_text(path, text)
    ppl, tokens = drift.perplexity(rows)
    return DriftQuality(windows=len(rows), tokens=tokens, window_tokens=spec.window_tokens, top_k=spec.top_k,
                        perplexity=ppl, corpus=f"{assets.NEEDLE.name}=={assets.NEEDLE.version} essays, last "
                        f"{len(rows)} x {spec.window_tokens} tokens", samples_file=str(path.relative_to(vdir)),
                        samples_sha256=hashlib.sha256(text.encode()).hexdigest())


class PromptStream:
    """Exact-length token-id prompts cut in order from packaged real prose, never reused, so
    every measured request of every cell is distinct (the prefix cache stays cold)."""

    def __init__(self, tokenizer):
        with open(assets.calibration_text("xsum")) as f:
            self._docs = iter([json.loads(line)["text"] for line in f])
        self._tok, self._ids = tokenizer, []

    def take(self, count: int, length: int, shared_prefix: bool = False) -> list[list[int]]:
        out = []
        while len(out) < count:
            while len(self._ids) < length:
                doc = next(self._docs, None)
                if doc is None:
                    raise ValueError(f"the packaged prose ran out of distinct {length}-token prompts "
                                     "(lower workload.num_requests, repeats or prompt lengths)")
                self._ids.extend(self._tok(doc + "\n\n", add_special_tokens=False)["input_ids"])
            out.append(self._ids[:length])
            self._ids = self._ids[length:]
        if shared_prefix and out:  # every prompt starts with the same first half
            head = out[0][:length // 2]
            out = [head + p[len(head):] for p in out]
        return out


def latency_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    return PromptStream(tokenizer).take(count, length)


def admitted(blocks: int, block: int, seq_len: int, max_num_seqs: int | None = None) -> int:
    """Sequences of seq_len tokens the KV pool holds at once (vLLM keeps one of its blocks as a
    null block), capped by max_num_seqs when given."""
    n = (blocks - 1) // math.ceil(seq_len / block)
    return min(n, max_num_seqs) if max_num_seqs else n


def kv_capacity(cache: dict, model_dir: Path, engine, kv_bytes_per_elem: int, workload) -> KVCapacity:
    cfg = json.loads((model_dir / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    layers = text_cfg["num_hidden_layers"]
    kv_heads = text_cfg.get("num_key_value_heads", text_cfg["num_attention_heads"])
    head_dim = text_cfg.get("head_dim") or text_cfg["hidden_size"] // text_cfg["num_attention_heads"]
    per_token = 2 * layers * kv_heads * head_dim * kv_bytes_per_elem
    block = int(cache.get("block_size") or 0) or None
    blocks = int(cache["num_gpu_blocks"]) if cache.get("num_gpu_blocks") not in (None, "None") else None
    pool = int(engine.kv_cache_gib * 2**30)
    tokens_cfg = None
    if block:
        tokens_cfg = (pool // per_token) // block * block
    seq_len = workload.prompt_tokens + workload.output_tokens
    tokens = blocks * block if blocks and block else None
    admission = kv_only = None
    if blocks and block:
        kv_only = admitted(blocks, block, seq_len)
        admission = min(kv_only, engine.max_num_seqs)
    mc = cache.get("kv_cache_max_concurrency")
    return KVCapacity(block_size=block, num_blocks=blocks, tokens=tokens,
                      max_concurrency=float(mc) if mc not in (None, "None") else None,
                      bytes_per_token_config=per_token, pool_bytes_config=pool,
                      tokens_config=tokens_cfg, admission_sequences=admission, admission_kv_only=kv_only)


GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:num_preemptions_total")


def find_knee(predicted: int, step, beyond: int = 3) -> tuple[int, int | None, int | None]:
    """The admission knee by ramping concurrency: step(c) sends c fixed-shape requests at once and
    says whether any queued (True), none did (False), or the step cannot tell (None: the requests
    never all ran together). Doubling from 1 while below the prediction, then the prediction and
    one past it; a step that queues sooner is bisected against the last clean one; if the
    prediction + 1 still runs clean, one more at a time, at most `beyond` past the prediction.
    Returns (knee, first concurrency that queued or None, concurrency that could not tell or None)."""
    ladder, c = [], 1
    while c < predicted:
        ladder.append(c)
        c *= 2
    ladder += [max(1, predicted) + i for i in range(beyond + 1)]
    clean, queued = 0, None
    for c in ladder:
        outcome = step(c)
        if outcome is None:
            return clean, None, c
        if outcome:
            queued = c
            break
        clean = c
    while queued is not None and queued - clean > 1:
        mid = (clean + queued) // 2
        outcome = step(mid)
        if outcome is None:
            return clean, queued, mid
        if outcome:
            queued = mid
        else:
            clean = mid
    return clean, queued, None


# vLLM's OpenAI server admits at most this many prompt tokens per engine step by default on CPU
# and on GPUs under 70 GB (8,192 / 16,384 on larger ones): the probe's output length is sized
# from it so that a step's requests are all admitted before the first of them finishes
MIN_TOKEN_BUDGET = 2048


def probe_shape(usable: int, block: int, max_num_seqs: int, max_model_len: int) -> tuple[int, int, int]:
    """(blocks per sequence, prompt tokens, output tokens) of the admission probe: whole blocks, the
    fewest per sequence that make the KV pool bind before max_num_seqs (as max_model_len allows);
    the output long enough that every request of a step is admitted (a little over one token budget
    of prompt per engine step) while the first is still decoding."""
    bps = max(1, -(-(usable + 1) // max_num_seqs))  # fewest blocks/sequence for KV to bind
    bps = min(bps, max(1, max_model_len // block))  # else the pool outlasts max_num_seqs sequences
    predicted = admitted(usable + 1, block, bps * block, max_num_seqs)
    admit_steps = -(-(predicted + 1) * bps * block // MIN_TOKEN_BUDGET)
    output = max(16, admit_steps * 3 // 2 + 8)
    while output > bps * block - 16 and (bps + 1) * block <= max_model_len:  # room for a prompt
        bps += 1
    output = min(output, bps * block - 16) if bps * block > 32 else max(2, bps * block // 2)
    return bps, bps * block - output, output


def ramp_step(server: Server, prompts: list[list[int]], output: int, usable_blocks: int, prompt_blocks: int,
              max_num_seqs: int, timeout: float, poll_s: float = 0.05) -> RampStep:
    """Send every prompt at once and poll the engine's scheduler gauges while they run. Queued: a
    request waited while the pool had no room to admit one more (vLLM reserves a prompt's blocks
    when it admits it) or max_num_seqs were running, or a sequence was preempted. Waiting alone is
    not queueing: below the knee the token budget admits long prompts a few per engine step. If
    neither, the step is clean only if all its requests were seen running together."""
    import threading

    samples: list[dict] = []
    start = server.gauges(GAUGES)
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                samples.append(server.gauges(GAUGES))
            except OSError:
                pass
            done.wait(poll_s)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        recs, wall = loadgen.run_closed_loop(server.port, SERVED_NAME, prompts, output, len(prompts), timeout)
    finally:
        done.set()
        t.join()
    samples.append(server.gauges(GAUGES))
    preempted = int(samples[-1]["vllm:num_preemptions_total"] - start["vllm:num_preemptions_total"])

    def full(g: dict) -> bool:  # no room to admit one more request of the probe shape
        free = round(usable_blocks * (1 - g["vllm:kv_cache_usage_perc"]))
        return free < prompt_blocks or g["vllm:num_requests_running"] >= max_num_seqs

    queued = preempted > 0 or any(g["vllm:num_requests_waiting"] > 0 and full(g) for g in samples)
    running = int(max(g["vllm:num_requests_running"] for g in samples))
    ok = [r for r in recs if r.ok]
    # all ran together: seen by the poll, or, poll-free, every request had its first token (so was
    # admitted) before any finished (the requests are sent together)
    overlapped = running >= len(prompts) or (len(ok) == len(recs) and ok and all(r.ttft is not None for r in ok)
                                             and max(r.ttft for r in ok) < min(r.e2e for r in ok))
    p50 = lambda xs: stats.percentiles([x * 1000 for x in xs if x is not None])["p50"]  # noqa: E731
    return RampStep(concurrency=len(prompts), max_running=running,
                    max_waiting=int(max(g["vllm:num_requests_waiting"] for g in samples)), preemptions=preempted,
                    kv_usage_peak=max(g["vllm:kv_cache_usage_perc"] for g in samples) or None, queued=queued,
                    overlapped=bool(overlapped), ttft_p50_ms=p50(r.ttft for r in ok),
                    ttft_max_ms=max((r.ttft * 1000 for r in ok if r.ttft is not None), default=None),
                    tpot_p50_ms=p50(r.tpot for r in ok),
                    e2e_p50_ms=p50(r.e2e for r in ok), completed=len(ok), failed=len(recs) - len(ok), duration_s=wall,
                    errors=sorted({r.error[:160] for r in recs if not r.ok}))


def admission_probe(server: Server, stream: PromptStream, engine, kv: KVCapacity, timeout: float,
                    poll_s: float = 0.05) -> AdmissionProbe | None:
    """The admission knee, measured by a concurrency ramp (find_knee) of one request shape
    (probe_shape); every step is a fresh batch of distinct prompts sent at once (ramp_step). An
    error mid-ramp ends it; the steps measured so far are kept and the note says why."""
    if not (kv.num_blocks and kv.block_size):
        return None
    block, usable = kv.block_size, kv.num_blocks - 1  # vLLM's block pool keeps one as its null block
    bps, prompt, output = probe_shape(usable, block, engine.max_num_seqs, engine.max_model_len)
    prompt_blocks = -(-prompt // block)
    kv_only = admitted(kv.num_blocks, block, bps * block)
    if kv_only < 1:
        return None
    predicted = min(kv_only, engine.max_num_seqs)
    binding = "kv" if kv_only < engine.max_num_seqs else "max_num_seqs"
    steps: dict[int, RampStep] = {}
    error = None

    def step(c: int) -> bool | None:
        nonlocal error
        try:
            st = steps[c] = ramp_step(server, stream.take(c, prompt), output, usable, prompt_blocks,
                                      engine.max_num_seqs, timeout, poll_s)
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            return None
        return True if st.queued else (False if st.overlapped else None)

    knee, first_queued, unclear = find_knee(predicted, step)
    if not steps:
        raise ValueError(f"admission probe: {error}")
    ordered = [steps[c] for c in sorted(steps)]
    at_knee = steps.get(knee)
    preempted = sum(s.preemptions for s in ordered)
    empirical = None
    if binding == "kv" and at_knee and at_knee.max_running == knee and not at_knee.preemptions \
            and at_knee.kv_usage_peak and output < block:
        # blocks in use at the knee (sequences x their blocks) over the engine's usage gauge: the
        # blocks that can hold sequences, without reading the engine's block count
        empirical = round(knee * bps / at_knee.kv_usage_peak) * block
    if error:
        note = f"ramp stopped at {unclear} concurrent requests by an error: {error}"
    elif unclear is not None:
        note = (f"ramp stopped at {unclear} concurrent requests: they never all ran together (at most "
                f"{steps[unclear].max_running}) and none waited for KV, so admission was not tested there")
    elif first_queued is None:
        note = f"no step queued up to {max(steps)} concurrent requests ({predicted} predicted)"
    elif knee == predicted:
        left = usable - kv_only * bps
        note = (f"knee as predicted: {knee} ran at once, {first_queued} queued; of the engine's {kv.num_blocks} "
                "blocks one is vLLM's null block (never holds tokens)"
                + (f", and {left} block(s) left after whole sequences are too few for one more"
                   if binding == "kv" and left else ""))
    else:
        note = f"knee at {knee} concurrent requests vs {predicted} predicted"
    if preempted:
        note += f"; {preempted} preemption(s)"
    failed = sum(s.failed for s in ordered)
    if failed:
        note += f"; {failed} request(s) failed: " + " | ".join(sorted({e for s in ordered for e in s.errors}))
    return AdmissionProbe(prompt_tokens=prompt, output_tokens=output, blocks_per_sequence=bps, predicted=predicted,
                          binding=binding, steps=ordered, knee=knee, first_queued=first_queued,
                          requests=sum(s.concurrency for s in ordered),
                          max_running=max(s.max_running for s in ordered), preemptions=preempted,
                          kv_usage_peak=max((s.kv_usage_peak or 0) for s in ordered) or None,
                          empirical_tokens=empirical, completed=sum(s.completed for s in ordered), note=note)


def run_systems(server: Server, model_dir: Path, recipe, variant: str, input_hash: str,
                kv_bytes_per_elem: int, act_bytes: int, log=print) -> SystemsResult:
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    w = recipe.workload
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=recipe.model.trust_remote_code)
    stream = PromptStream(tok)
    warm = stream.take(w.warmup_requests, w.prompt_tokens)
    if warm:
        loadgen.run_closed_loop(server.port, SERVED_NAME, warm, w.output_tokens,
                                min(w.concurrency, len(warm)), w.request_timeout_s)
    latency = measure_cell(server, stream, w, w.prompt_tokens, w.output_tokens, w.concurrency, "unique")
    cells = [CellResult(cell=c.model_dump(), latency=Latency(**measure_cell(
        server, stream, w, c.prompt_tokens, c.output_tokens, c.concurrency, c.prefix))) for c in w.matrix]
    cache = server.cache_config()
    kv = kv_capacity(cache, model_dir, recipe.engine, kv_bytes_per_elem, w)
    if kv.num_blocks and kv.block_size:  # admission for every shape of the matrix, too
        for c in cells:
            c.admission_sequences = admitted(kv.num_blocks, kv.block_size,
                                             c.cell["prompt_tokens"] + c.cell["output_tokens"],
                                             recipe.engine.max_num_seqs)
    if w.admission_probe:
        try:
            kv.probe = admission_probe(server, stream, recipe.engine, kv, w.request_timeout_s)
        except (OSError, ValueError) as exc:  # an optional probe must not cost the measured cells
            log(f"admission probe failed: {type(exc).__name__}: {exc}")
    error = None
    if server.proc.poll() is not None:
        error = f"engine exited (code {server.proc.returncode}) during the workload"
    elif latency["completed"] == 0:
        error = f"no request completed ({latency['failed']} failed, {latency['timed_out']} timed out)"
    loaded = server.loaded_weights()  # logged by the engine once its weights were in place
    if loaded:  # the decode floor from the bytes the engine really holds
        weights, source = loaded["parameters"], "parameters as loaded (reported by the engine)"
    else:
        weights, source = loaded_weight_bytes(model_dir, act_bytes), FROM_CHECKPOINT
    return SystemsResult(
        variant=variant, input_hash=input_hash, status="failed" if error else "ok", error=error,
        duration_s=time.perf_counter() - t0,
        checkpoint_bytes=weight_bytes(model_dir), engine_start_s=server.start_s, kv=kv,
        weight_memory=loaded or {},
        weight_memory_bytes=loaded["parameters"] + loaded["buffers"] if loaded else None,
        workload={**w.model_dump(), "prefix_cache": "enabled; primary cell: prompts distinct (cold); "
                  "'shared' matrix cells: same first half (warm after the first request)"},
        latency=Latency(**latency), cells=cells,
        roofline=roofline(weights, kv, w, latency["tpot_ms"]["p50"], source))


def loaded_weight_bytes(model_dir: Path, engine_elem_bytes: int) -> int:
    """Weight bytes the engine reads per step. A dense checkpoint is upcast on load when the
    engine computes in a wider dtype (bf16 file, float32 engine: twice the bytes); a quantized
    checkpoint is read as stored (its few unquantized tensors are ignored: approximate)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    stored = {"float32": 4, "bfloat16": 2, "float16": 2}.get(cfg.get("dtype") or cfg.get("torch_dtype"), 2)
    factor = 1.0 if "quantization_config" in cfg else engine_elem_bytes / stored
    return int(weight_bytes(model_dir) * factor)


def measure_cell(server: Server, stream: PromptStream, w, prompt_tokens: int, output_tokens: int,
                 concurrency: int, prefix: str) -> dict:
    """One cell, `w.repeats` times on fresh prompts; the summary of all its requests."""
    records, wall, repeat_p50 = [], 0.0, []
    for _ in range(w.repeats):
        batch = stream.take(w.num_requests, prompt_tokens, shared_prefix=prefix == "shared")
        recs, secs = loadgen.run_closed_loop(server.port, SERVED_NAME, batch, output_tokens, concurrency,
                                             w.request_timeout_s)
        records += recs
        wall += secs
        p50 = stats.percentiles([r.tpot * 1000 for r in recs if r.tpot is not None])["p50"]
        if p50 is not None:
            repeat_p50.append(p50)
    latency = loadgen.summarize(records, wall, w.slo_ttft_ms, w.slo_tpot_ms, w.cost_per_hour_usd)
    latency["repeats_tpot_p50_ms"] = repeat_p50
    if len(repeat_p50) > 1:
        latency["tpot_p50_spread"] = (max(repeat_p50) - min(repeat_p50)) / stats.percentiles(repeat_p50)["p50"]
    return latency


FROM_CHECKPOINT = "checkpoint bytes, dense ones scaled to the engine dtype"


def roofline(weights: int, kv: KVCapacity, w, tpot_p50_ms: float | None,
             weights_source: str = FROM_CHECKPOINT) -> Roofline | None:
    """Decode is bandwidth bound: each step reads every weight once (as loaded) plus the batch's
    KV cache. Floor TPOT = bytes per step / bandwidth. Approximate: ignores activations, caches."""
    if not kv.bytes_per_token_config:
        return None
    if w.memory_bandwidth_gbps:
        bw, src = w.memory_bandwidth_gbps, "recipe (workload.memory_bandwidth_gbps)"
    else:
        bw, src = measure_bandwidth_gbps(), "measured here: numpy copy of 256 MiB, one thread, best of 5"
    mean_ctx = w.prompt_tokens + w.output_tokens / 2  # average context over the decode phase
    step = int(weights + w.concurrency * mean_ctx * kv.bytes_per_token_config)
    floor_ms = step / (bw * 1e9) * 1000
    return Roofline(bandwidth_gbps=bw, bandwidth_source=src, bytes_per_step=step, floor_tpot_ms=floor_ms,
                    weight_bytes=weights, weight_bytes_source=weights_source,
                    measured_over_floor=tpot_p50_ms / floor_ms if tpot_p50_ms else None)


def measure_bandwidth_gbps(mib: int = 256, tries: int = 5) -> float:
    """Host memory bandwidth a single thread sees (read + write of a large copy)."""
    import numpy as np

    src = np.ones(mib * 2**20 // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def logprob_args(recipe) -> list[str]:
    """The drift suite's top-k above vLLM's default cap of 20: raised for every variant alike."""
    k = recipe.quality.drift.top_k
    return ["--max-logprobs", str(k)] if "drift" in recipe.quality.suites and k > 20 else []


def evaluate(model_dir: Path, recipe, variant: str, vdir: Path, dtype: str,
             need_quality: str | None, need_systems: str | None, tasks_dir: Path,
             log=print, extra_args: list[str] | None = None) -> tuple[QualityResult | None, SystemsResult | None]:
    """Start one engine; run whichever of quality/systems are missing (their input hashes)."""
    quality = systems = None
    extra_args = list(extra_args or []) + logprob_args(recipe)
    act_bytes = 4 if dtype == "float32" else 2
    kv_bytes = 1 if "fp8" in extra_args else act_bytes  # --kv-cache-dtype fp8
    with Server(model_dir, recipe.engine, dtype, vdir / "engine.log",
                recipe.model.trust_remote_code, extra_args) as server:
        log(f"engine ready in {server.start_s:.0f} s (port {server.port})")
        if need_quality:
            quality = run_quality(server, model_dir, recipe, variant, vdir, need_quality, tasks_dir)
            write_json(vdir / "quality.json", quality)
            log("quality: " + ", ".join([f"{s} {r.accuracy:.3f} (n={r.n})" for s, r in quality.suites.items()]
                                        + ([f"drift PPL {quality.drift.perplexity:.2f} ({quality.drift.tokens} "
                                            "tokens)"] if quality.drift else [])))
        if need_systems:
            systems = run_systems(server, model_dir, recipe, variant, need_systems, kv_bytes, act_bytes, log)
        server.stop()
        if systems is not None:
            systems.peak_memory_bytes = server.memory.peak_tree_rss
            systems.device_memory_peak_bytes = server.memory.peak_device or None
            systems.device_memory_source = server.memory.device_source
            write_json(vdir / "systems.json", systems)
            lat = systems.latency
            log(f"systems: TTFT p50 {lat.ttft_ms.p50:.0f} ms, TPOT p50 {lat.tpot_ms.p50:.1f} ms, "
                f"KV {systems.kv.tokens} tokens, peak {systems.peak_memory_bytes / 2**30:.2f} GiB"
                if lat.completed else f"systems: all {lat.failed + lat.timed_out} requests failed")
    return quality, systems
