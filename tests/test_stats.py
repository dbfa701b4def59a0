"""Statistics against values worked by hand."""

from __future__ import annotations

import math

import pytest

from pipeline.measure import stats
from pipeline.runstore import hash_obj


def test_wilson_known_values():
    lo, hi = stats.wilson(50, 100)
    assert lo == pytest.approx(0.40383, abs=1e-4) and hi == pytest.approx(0.59617, abs=1e-4)
    lo, hi = stats.wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.27753, abs=1e-4)
    assert all(math.isnan(x) for x in stats.wilson(0, 0))


def test_mcnemar_exact():
    # b=1, c=9: p = 2 * (C(10,0) + C(10,1)) / 2^10
    assert stats.mcnemar_exact(1, 9) == pytest.approx(22 / 1024)
    assert stats.mcnemar_exact(9, 1) == stats.mcnemar_exact(1, 9)
    assert stats.mcnemar_exact(5, 5) == 1.0
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(0, 12) == pytest.approx(2 / 4096)


def test_paired_bootstrap():
    same = [1, 0, 1, 1, 0] * 20
    assert stats.paired_bootstrap_delta(same, same) == (0.0, 0.0, 0.0)
    worse = [0] * 100
    d, lo, hi = stats.paired_bootstrap_delta([1] * 100, worse)
    assert (d, lo, hi) == (-1.0, -1.0, -1.0)
    base = [1] * 60 + [0] * 40
    var = [1] * 50 + [0] * 50  # 10 correct->wrong flips
    d, lo, hi = stats.paired_bootstrap_delta(base, var, samples=4000, seed=3)
    assert d == pytest.approx(-0.10)
    assert -0.17 < lo < -0.10 < hi < -0.04
    with pytest.raises(ValueError):
        stats.paired_bootstrap_delta([1, 0], [1])


def test_percentiles():
    p = stats.percentiles(list(range(1, 101)))
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert stats.percentiles([]) == {"p50": None, "p95": None, "p99": None}


def test_holm():
    assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def test_hash_is_order_independent_for_keys_and_sensitive_to_values():
    assert hash_obj({"a": 1, "b": [1, 2]}) == hash_obj({"b": [1, 2], "a": 1})
    assert hash_obj({"a": 1}) != hash_obj({"a": 2})
    assert hash_obj([1, 2]) != hash_obj([2, 1])


def test_agresti_min_keeps_width_without_flips():
    lo, hi = stats.agresti_min_delta(0, 0, 20)
    assert lo < -0.05 and hi > 0.05  # 20 items without a flip cannot prove a 5-point margin
    lo, hi = stats.agresti_min_delta(0, 0, 2000)
    assert -0.002 < lo < 0 < hi < 0.002
    d, lo, hi = stats.paired_delta_ci([1] * 12 + [0] * 8, [1] * 12 + [0] * 8)
    assert d == 0 and lo < -0.05  # the union is at least as wide as Agresti-Min
    # b=10 correct->wrong of n=100: centred near -0.1
    lo, hi = stats.agresti_min_delta(10, 0, 100)
    assert lo < -0.10 < hi < 0


def test_goodput_and_cost():
    from pipeline.measure.loadgen import RequestRecord, summarize

    fast = RequestRecord(ok=True, ttft=0.1, e2e=1.1, output_tokens=11)   # TPOT 100 ms
    slow = RequestRecord(ok=True, ttft=0.5, e2e=2.5, output_tokens=11)   # TTFT 500 ms, TPOT 200 ms
    bad = RequestRecord(ok=False, error="HTTP 500")
    out = summarize([fast, slow, bad], wall_s=10.0, slo_ttft_ms=200, slo_tpot_ms=150, cost_per_hour=3.6)
    assert out["slo_attainment"] == pytest.approx(1 / 3) and out["goodput_req_per_s"] == pytest.approx(0.1)
    assert out["completed"] == 2 and out["failed"] == 1
    # 3.6 $/h for 10 s = 0.01 $ over 2 completed requests -> 5 $ per 1k
    assert out["cost_per_1k_requests_usd"] == pytest.approx(5.0)
    assert summarize([fast], 1.0)["goodput_req_per_s"] is None


def test_roofline_arithmetic():
    from pipeline.recipe.schema import WorkloadSpec
    from pipeline.results import KVCapacity
    from pipeline.stages.systems import measure_bandwidth_gbps, roofline

    kv = KVCapacity(block_size=128, num_blocks=10, tokens=1280, max_concurrency=1.0,
                    bytes_per_token_config=1000)
    w = WorkloadSpec(prompt_tokens=100, output_tokens=20, concurrency=2, num_requests=2,
                     memory_bandwidth_gbps=10.0)
    r = roofline(1_000_000, kv, w, tpot_p50_ms=1.0)
    assert r.bytes_per_step == 1_000_000 + 2 * 110 * 1000
    assert r.floor_tpot_ms == pytest.approx(1_220_000 / 10e9 * 1000)
    assert r.measured_over_floor == pytest.approx(1.0 / r.floor_tpot_ms)
    assert 0.5 < measure_bandwidth_gbps(mib=16, tries=2) < 2000


@pytest.mark.parametrize("true_knee,predicted,steps", [
    (7, 7, [1, 2, 4, 7, 8]),          # as predicted: doubling below it, then it and one past it
    (5, 7, [1, 2, 4, 7, 5, 6]),       # queued sooner: bisected between 4 (clean) and 7 (queued)
    (1, 7, [1, 2]),
    (3, 16, [1, 2, 4, 3]),
    (9, 7, [1, 2, 4, 7, 8, 9, 10]),   # the prediction was low: one more at a time past it
    (15, 15, [1, 2, 4, 8, 15, 16]),
    (1, 1, [1, 2]),
])
def test_find_knee_ramps_to_the_first_queueing_step(true_knee, predicted, steps):
    from pipeline.stages.admission import find_knee

    sent = []

    def step(c):
        sent.append(c)
        return c > true_knee

    assert find_knee(predicted, step) == (true_knee, true_knee + 1, None)
    assert sent == steps


def test_find_knee_stops_looking_past_the_prediction():
    from pipeline.stages.admission import find_knee

    sent = []
    assert find_knee(4, lambda c: sent.append(c) or False, beyond=3) == (7, None, None)
    assert sent == [1, 2, 4, 5, 6, 7]


def test_find_knee_stops_at_a_step_that_cannot_tell():
    from pipeline.stages.admission import find_knee

    # requests that never all ran together (and none waited for KV) say nothing about admission
    assert find_knee(15, lambda c: None if c >= 8 else False) == (4, None, 8)
    assert find_knee(15, lambda c: {15: True, 11: None}.get(c, False)) == (8, 15, 11)  # while bisecting


def test_the_client_counts_requests_streaming_at_once():
    from pipeline.measure.loadgen import RequestRecord, max_streaming

    def rec(sent, first, last, ok=True):
        return RequestRecord(ok=ok, sent=sent, ttft=first - sent, e2e=last - sent, output_tokens=4)

    # sent together, first tokens at 1, 2, 3, all before the earliest end (4): 3 at once
    assert max_streaming([rec(0, 1, 5), rec(0, 2, 4), rec(0.5, 3, 6)]) == 3
    # one began streaming after another ended: never more than 2 together (a tie is not together)
    assert max_streaming([rec(0, 1, 3), rec(0, 2, 4), rec(0, 3, 5)]) == 2
    # a failed request streamed nothing worth counting
    assert max_streaming([rec(0, 1, 5), rec(0, 2, 4, ok=False)]) == 1
    assert max_streaming([]) == 0


def test_the_ramp_polls_about_twenty_times_a_request():
    from pipeline.results import RampStep
    from pipeline.stages.admission import poll_interval

    def step(e2e_ms):
        return RampStep(concurrency=1, max_running=1, max_waiting=0, preemptions=0, queued=False,
                        e2e_p50_ms=e2e_ms, completed=1, failed=0)

    assert poll_interval(None) == 0.01                       # nothing known yet: the fastest
    assert poll_interval(step(80)) == 0.01                   # a tiny model's step: as fast as allowed
    assert poll_interval(step(600)) == pytest.approx(0.03)   # 600 ms / 20
    assert poll_interval(step(4000)) == 0.05                 # a slow engine: no faster than needed


def test_a_ramp_step_samples_the_gauges_once_all_requests_are_admitted(monkeypatch):
    """The moment the last request has its first token the gauges are read: a step shorter than the
    poll interval (a fast engine's steps last ~0.1 s) is still seen running by the engine."""
    import threading

    from pipeline.measure import loadgen
    from pipeline.stages import admission

    n, state, seen_all = 4, {"running": 0}, threading.Event()

    class Engine:  # gauges as the engine would show them: all running once every first token is out
        port, served_name = 0, "model"

        def gauges(self):  # interface.GAUGES
            if state["running"] == n:
                seen_all.set()
            return {"running": state["running"], "waiting": 0, "kv_usage": 0.5 * state["running"] / n,
                    "preemptions": 0, "finished": 0}

    def closed_loop(port, model, prompts, max_tokens, concurrency, timeout, on_done=None, on_first=None):
        recs = [loadgen.RequestRecord(ok=True, sent=0.0, ttft=1.0 + i / 10, e2e=2.0, output_tokens=max_tokens)
                for i in range(len(prompts))]
        for _ in prompts:
            state["running"] += 1
            on_first()
        seen_all.wait(2.0)  # the engine keeps decoding until it has been looked at (or 2 s pass)
        state["running"] = 0
        return recs, 2.0

    monkeypatch.setattr(loadgen, "run_closed_loop", closed_loop)
    # a poll interval far longer than the step: only the start, the all-admitted sample and the end
    st = admission.ramp_step(Engine(), [[1, 2]] * n, 8, usable_blocks=8, prompt_blocks=1, max_num_seqs=8,
                             timeout=10, poll_s=60)
    assert (st.max_running, st.max_streaming, st.kv_usage_peak) == (n, n, 0.5), st
    assert st.overlapped and not st.queued and st.completed == n


@pytest.mark.parametrize("usable,block,seqs,max_len,expect", [
    (7, 128, 8, 512, (1, 112, 16)),          # the engine test's 4 MiB pool
    (181, 128, 16, 2048, (12, 1510, 26)),    # default model, 1 GiB pool, CPU: 12 engine steps to admit 16
    (181, 128, 16, 1024, (8, 1003, 21)),     # max_model_len caps the sequence: max_num_seqs binds
    (29000, 16, 256, 8192, (114, 1474, 350)),  # a large GPU pool: output spans blocks, 228 steps to admit
])
def test_probe_shape(usable, block, seqs, max_len, expect):
    from pipeline.stages.admission import MIN_TOKEN_BUDGET, probe_shape

    bps, prompt, output = probe_shape(usable, block, seqs, max_len)
    assert (bps, prompt, output) == expect
    assert prompt + output == bps * block <= max_len and prompt >= 16
    predicted = min(usable // bps, seqs)
    admit_steps = -(-(predicted + 1) * bps * block // MIN_TOKEN_BUDGET)
    assert output > admit_steps  # the last request is admitted while the first still decodes
