"""The admission knee, measured: a concurrency ramp of one request shape against the KV pool.

A request shape of whole KV blocks is sized so the pool binds before max_num_seqs (probe_shape);
concurrency is ramped 1, 2, 4, ... to the prediction and one past it, bisected when requests
queue sooner (find_knee); each step is a fresh batch sent at once while the engine's scheduler
gauges are polled (ramp_step). docs/admission-knee.md explains what counts as queueing.
"""

from __future__ import annotations

from pipeline.engines.interface import Engine
from pipeline.measure import loadgen, stats
from pipeline.measure.capacity import admitted
from pipeline.measure.prompts import PromptStream
from pipeline.progress import Progress
from pipeline.results import AdmissionProbe, KVCapacity, RampStep


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


def ramp_step(server: Engine, prompts: list[list[int]], output: int, usable_blocks: int, prompt_blocks: int,
              max_num_seqs: int, timeout: float, poll_s: float = 0.01) -> RampStep:
    """Send every prompt at once and poll the engine's scheduler gauges while they run, once more the
    moment the last request has its first token (all admitted: a fast engine's step lasts about a
    tenth of a second, a poll or two). Queued: a request waited while the pool had no room to admit
    one more (vLLM reserves a prompt's blocks when it admits it) or max_num_seqs were running, or a
    sequence was preempted. Waiting alone is not queueing: below the knee the token budget admits
    long prompts a few per engine step. If neither, the step is clean only if all its requests were
    seen running together, by the gauge or by the client (all streaming at once)."""
    import threading

    samples: list[dict] = []
    start = server.gauges()
    done, wake, lock = threading.Event(), threading.Event(), threading.Lock()
    firsts = [0]

    def poll() -> None:
        while not done.is_set():
            try:
                samples.append(server.gauges())
            except OSError:
                pass
            wake.wait(poll_s)
            wake.clear()

    def on_first() -> None:
        with lock:
            firsts[0] += 1
            if firsts[0] == len(prompts):
                wake.set()

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        recs, wall = loadgen.run_closed_loop(server.port, server.served_name, prompts, output, len(prompts), timeout,
                                             on_first=on_first)
    finally:
        done.set()
        wake.set()
        t.join()
    samples.append(server.gauges())
    preempted = int(samples[-1]["preemptions"] - start["preemptions"])

    def full(g: dict) -> bool:  # no room to admit one more request of the probe shape
        free = round(usable_blocks * (1 - g["kv_usage"]))
        return free < prompt_blocks or g["running"] >= max_num_seqs

    queued = preempted > 0 or any(g["waiting"] > 0 and full(g) for g in samples)
    running = int(max(g["running"] for g in samples))
    streaming = loadgen.max_streaming(recs)
    ok = [r for r in recs if r.ok]
    p50 = lambda xs: stats.percentiles([x * 1000 for x in xs if x is not None])["p50"]  # noqa: E731
    return RampStep(concurrency=len(prompts), max_running=running, max_streaming=streaming,
                    max_waiting=int(max(g["waiting"] for g in samples)), preemptions=preempted,
                    kv_usage_peak=max(g["kv_usage"] for g in samples) or None, queued=queued,
                    overlapped=max(running, streaming) >= len(prompts), ttft_p50_ms=p50(r.ttft for r in ok),
                    ttft_max_ms=max((r.ttft * 1000 for r in ok if r.ttft is not None), default=None),
                    tpot_p50_ms=p50(r.tpot for r in ok),
                    e2e_p50_ms=p50(r.e2e for r in ok), completed=len(ok), failed=len(recs) - len(ok), duration_s=wall,
                    errors=sorted({r.error[:160] for r in recs if not r.ok}))


def poll_interval(last: RampStep | None, lo: float = 0.01, hi: float = 0.05) -> float:
    """Seconds between gauge polls: a twentieth of the last step's median request, within [lo, hi]
    (lo before any step). A poll costs the server ~5 ms of CPU, so polling a real model's
    seconds-long steps every 10 ms would take a third of a core from the engine it measures; a tiny
    model's steps last ~0.1 s, where 50 ms polls once all missed."""
    if last is None or not last.e2e_p50_ms:
        return lo
    return min(hi, max(lo, last.e2e_p50_ms / 1000 / 20))


def admission_probe(server: Engine, stream: PromptStream, engine, kv: KVCapacity, timeout: float,
                    label: str = "", shape: tuple[int, int] | None = None) -> AdmissionProbe | None:
    """The admission knee, measured by a concurrency ramp (find_knee) of one request shape: `shape`
    (prompt, output tokens; the run passes its workload's, so every variant's knee is of the same
    requests), else one that fills the pool before max_num_seqs (probe_shape). Every step is a fresh
    batch of distinct prompts sent at once (ramp_step), its gauges polled about 20 times per request
    lifetime of the step before (poll_interval). An error mid-ramp ends it; the steps measured so far
    are kept and the note says why."""
    if not (kv.num_blocks and kv.block_size):
        return None
    block, usable = kv.block_size, kv.num_blocks - kv.null_blocks
    if shape:
        prompt, output = shape
        bps = -(-(prompt + output) // block)
    else:
        bps, prompt, output = probe_shape(usable, block, engine.max_num_seqs, engine.max_model_len)
    prompt_blocks = -(-prompt // block)
    kv_only = admitted(kv.num_blocks, block, bps * block)
    if kv_only < 1:
        return None
    predicted = min(kv_only, engine.max_num_seqs)
    binding = "kv" if kv_only < engine.max_num_seqs else "max_num_seqs"
    steps: dict[int, RampStep] = {}
    error = None
    bar = Progress(f"admission ramp (predicted knee {predicted})", None, "steps", label)

    def step(c: int) -> bool | None:
        nonlocal error
        try:
            last = next(reversed(steps.values()), None)  # the step run just before (also when bisecting)
            st = steps[c] = ramp_step(server, stream.take(c, prompt), output, usable, prompt_blocks,
                                      engine.max_num_seqs, timeout, poll_interval(last))
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            return None
        finally:
            bar.advance()
        return True if st.queued else (False if st.overlapped else None)

    with bar:  # ticks while a step runs
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
    note = _ramp_note(steps, kv, predicted, kv_only, bps, usable, binding, knee, first_queued, unclear, error)
    return AdmissionProbe(prompt_tokens=prompt, output_tokens=output, blocks_per_sequence=bps, predicted=predicted,
                          binding=binding, steps=ordered, knee=knee, first_queued=first_queued,
                          requests=sum(s.concurrency for s in ordered),
                          max_running=max(s.max_running for s in ordered), preemptions=preempted,
                          kv_usage_peak=max((s.kv_usage_peak or 0) for s in ordered) or None,
                          empirical_tokens=empirical, completed=sum(s.completed for s in ordered), note=note)


def _ramp_note(steps: dict[int, RampStep], kv: KVCapacity, predicted: int, kv_only: int, bps: int, usable: int,
               binding: str, knee: int, first_queued: int | None, unclear: int | None, error: str | None) -> str:
    """What the ramp found, in words: where it stopped and why, and what the rest of the pool is."""
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
                f"blocks {kv.null_blocks} never hold tokens (the engine's null block)"
                + (f", and {left} block(s) left after whole sequences are too few for one more"
                   if binding == "kv" and left else ""))
    else:
        note = f"knee at {knee} concurrent requests vs {predicted} predicted"
    ordered = [steps[c] for c in sorted(steps)]
    preempted = sum(s.preemptions for s in ordered)
    if preempted:
        note += f"; {preempted} preemption(s)"
    failed = sum(s.failed for s in ordered)
    if failed:
        note += f"; {failed} request(s) failed: " + " | ".join(sorted({e for s in ordered for e in s.errors}))
    return note
