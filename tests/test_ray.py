"""The Ray executor on a private local Ray instance: a two-variant tiny-model matrix.

Both variants run at the same time, the results equal the local executor's on everything
deterministic, and a Ray worker SIGKILLed in the middle of a variant's evaluation is
retried without redoing the stages that had finished, ending in a complete run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.setup import envs
from pipeline.store import provenance
from tests import native, tinymodel

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent


def recipe(tmp: Path, model: Path, name: str, seed: int) -> Path:
    # float32 engine and calibration: the numerics of every CPU kind. With native bf16 (AVX512-BF16, AMX) the
    # auto dtype is bfloat16, and the two runs' W8A8 checkpoints (quantized apart: different seeds, and a Ray
    # task's thread count) then moved one PIQA log-likelihood by 0.14 nats (AMD EPYC Zen 5, 2026-12-01)
    r = {"schema_version": 1, "name": name, "model": {"path": str(model)},
         "engine": {"max_model_len": 512, "max_num_seqs": 8, "kv_cache_gib": 0.25, "seed": seed, "dtype": "float32"},
         "calibration": {"num_samples": 4, "max_seq_len": 64, "dtype": "float32"},
         "variants": [native.eight_bit_variant(model, "qa"),
                      {"name": "rtn", "scheme": "rtn_w4a16", "group_size": 64}],
         "quality": {"suites": ["piqa"], "limit": 10, "bootstrap_samples": 200, "agreement_sample": 0},
         "workload": {"prompt_tokens": 32, "output_tokens": 8, "concurrency": 2, "num_requests": 4,
                      "warmup_requests": 1, "repeats": 2},
         "gates": [{"metric": "accuracy_delta", "op": ">=", "threshold": -1.0}],
         "runs_dir": str(tmp / "runs")}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def run_dir(tmp: Path, name: str) -> Path:
    return sorted((tmp / "runs").glob(f"{name}-*"))[-1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    envs.ensure_extra("ray")
    tmp = tmp_path_factory.mktemp("ray")
    # a model no earlier run has seen: every cache is cold, so each stage really runs (and can be killed)
    model = tinymodel.build(tmp / "tiny", seed=int.from_bytes(os.urandom(2), "little"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_DEDUP_LOGS": "0"}
    # different engine seeds: neither run can take the other's results from the result cache
    local_recipe, ray_recipe = recipe(tmp, model, "local", 101), recipe(tmp, model, "onray", 202)
    t0 = time.perf_counter()
    local = subprocess.run([sys.executable, "-m", "pipeline.cli", str(local_recipe)], capture_output=True,
                           text=True, cwd=tmp, env=env, timeout=1800)
    local_wall = time.perf_counter() - t0

    t0 = time.perf_counter()
    log = open(tmp / "ray-driver.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", str(ray_recipe), "--ray", "local"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=env, start_new_session=True)
    killed = None
    deadline = time.time() + 1500
    while proc.poll() is None and time.time() < deadline:  # kill qa's worker once its engine is up
        runs_root = tmp / "runs"
        dirs = sorted(runs_root.glob("onray-*")) if runs_root.exists() else []
        if killed is None and dirs:
            pid_file, engine_log = dirs[-1] / "qa" / ".ray-evaluate.pid", dirs[-1] / "qa" / "engine.log"
            if pid_file.exists() and engine_log.exists() and "Starting to load model" in engine_log.read_text():
                killed = int(pid_file.read_text().split()[0])
                quantize_mtime = (dirs[-1] / "qa" / "quantize.json").stat().st_mtime_ns
                os.kill(killed, signal.SIGKILL)
        time.sleep(1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    ray_wall = time.perf_counter() - t0
    log.close()
    return {"tmp": tmp, "local": local, "local_dir": run_dir(tmp, "local"), "ray_rc": proc.returncode,
            "ray_log": (tmp / "ray-driver.log").read_text(), "ray_dir": run_dir(tmp, "onray"), "killed": killed,
            "quantize_mtime": quantize_mtime if killed else None, "walls": (local_wall, ray_wall)}


def load(d: Path, *parts):
    return json.loads(d.joinpath(*parts).read_text())


def test_both_complete(runs):
    assert runs["local"].returncode == 0, runs["local"].stdout[-2000:] + runs["local"].stderr[-2000:]
    assert runs["ray_rc"] == 0, runs["ray_log"][-4000:]
    for d in (runs["local_dir"], runs["ray_dir"]):
        so = load(d, "signoff.json")
        assert [v["variant"] for v in so["variants"]] == ["qa", "rtn"]
        assert all(v["verdict"] != "FAILED-TO-RUN" for v in so["variants"]), so
    assert "ray: 1 node(s)" in runs["ray_log"] and "finished on" in runs["ray_log"]
    print(f"\ntiny two-variant matrix: local {runs['walls'][0]:.0f} s, ray (with one worker killed and "
          f"retried) {runs['walls'][1]:.0f} s")


def test_variants_ran_concurrently(runs):
    acc = [json.loads(line) for line in (runs["ray_dir"] / "stage-accounting.jsonl").read_text().splitlines()]
    spans = {(a["variant"], a["stage"]): (a["t0"], a["t"]) for a in acc}
    (a0, a1), (b0, b1) = spans[("qa", "quantize")], spans[("rtn", "quantize")]
    assert a0 < b1 and b0 < a1, spans  # the two quantize stages overlapped in time


def test_a_measuring_engine_held_its_node_alone(runs):
    """Every evaluate stage (its engine measures latency and memory) ran with no other stage on the node:
    the Ray resource quantize_eval_host, taken whole by evaluate and in slivers by quantize."""
    acc = [json.loads(line) for line in (runs["ray_dir"] / "stage-accounting.jsonl").read_text().splitlines()]
    spans = [(a["variant"], a["stage"], a["t0"], a["t"]) for a in acc]
    for v, stage, t0, t1 in spans:
        if stage != "evaluate":
            continue
        beside = [(w, st) for w, st, s0, s1 in spans if (w, st) != (v, stage) and s0 < t1 and t0 < s1]
        assert not beside, (v, beside, spans)


def test_nodes_without_the_host_resource_are_refused_before_any_task():
    from pipeline.run.preflight import PreflightError
    from pipeline.run.ray_executor import HOST, check_host_resource

    good = {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0, HOST: 1.0}}
    head = {"Alive": True, "NodeManagerAddress": "10.0.0.9", "Resources": {"CPU": 0.0}}
    check_host_resource([good, head])
    with pytest.raises(PreflightError, match=r"10\.0\.0\.2 do not declare the resource quantize_eval_host"):
        check_host_resource([good, {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0}}])


def test_results_match_the_local_executor(runs):
    for name in ("baseline", "qa", "rtn"):
        for d_name in ("local_dir", "ray_dir"):
            assert load(runs[d_name], name, "quality.json")["status"] == "ok"
        local, ray = [[json.loads(x) for x in (runs[d] / name / "samples" / "piqa.jsonl").read_text().splitlines()]
                      for d in ("local_dir", "ray_dir")]
        assert [r["doc_id"] for r in local] == [r["doc_id"] for r in ray], name
        for a, b in zip(local, ray, strict=True):
            # the same weights and prompts; the engine's batches depend on request timing, and batched
            # float kernels sum in another order, so log-likelihoods agree closely, not bit for bit, and
            # only an item whose choices nearly tie (per character, as acc_norm compares them) may flip
            assert max(abs(x - y) for x, y in zip(a["loglikelihoods"], b["loglikelihoods"], strict=True)) < 0.1, (name, a, b)
            if a["correct"] != b["correct"]:
                per_char = [ll / len(c) for ll, c in zip(a["loglikelihoods"], a["choices"], strict=True)]
                assert abs(per_char[0] - per_char[1]) < 2e-3, (name, a["doc_id"], per_char)
    for name in ("qa", "rtn"):
        a, b = load(runs["local_dir"], name, "quantize.json"), load(runs["ray_dir"], name, "quantize.json")
        assert a["checkpoint_bytes"] == b["checkpoint_bytes"] and a["facts"] == b["facts"]
        assert load(runs["local_dir"], name, "support.json") == load(runs["ray_dir"], name, "support.json")
    for name in ("baseline", "qa"):
        if not native.systems_measured(runs["local_dir"] / name):  # served emulated (AVX2): both runs say why
            assert load(runs["local_dir"], name, "systems.json")["status"] == "skipped"
            assert load(runs["ray_dir"], name, "systems.json")["status"] == "skipped"
            continue
        sa, sb = load(runs["local_dir"], name, "systems.json"), load(runs["ray_dir"], name, "systems.json")
        assert sa["kv"]["tokens"] == sb["kv"]["tokens"] and sa["latency"]["completed"] == sb["latency"]["completed"]
        # a fixed pool (engine.kv_cache_gib): the same KV tokens whatever the weights, and the plan says so
        assert sa["kv"]["plan"]["mode"] == "fixed" and sa["kv"]["plan"]["pool_bytes"] == 2**28
        base = load(runs["local_dir"], "baseline", "systems.json")["kv"]["tokens"]
        fp8_kv = name != "baseline" and load(runs["local_dir"], name, "support.json")["kv_fp8"]
        # an FP8 KV cache holds a float32 engine's K and V in 1 byte instead of 4: 4x the tokens in the same pool
        ratio = provenance.kv_elem_bytes("float32") // provenance.kv_elem_bytes("float32", "fp8") if fp8_kv else 1
        assert ratio in (1, 4) and abs(sa["kv"]["tokens"] - ratio * base) <= 128, (name, sa["kv"]["tokens"], base)
    va = {v["variant"]: v["verdict"] for v in load(runs["local_dir"], "signoff.json")["variants"]}
    vb = {v["variant"]: v["verdict"] for v in load(runs["ray_dir"], "signoff.json")["variants"]}
    assert va == vb


def test_killed_worker_is_retried_without_redoing_finished_stages(runs):
    assert runs["killed"], "the test never saw qa's evaluation start on a Ray worker"
    d = runs["ray_dir"] / "qa"
    new_pid = int((d / ".ray-evaluate.pid").read_text().split()[0])
    assert new_pid != runs["killed"]  # a retry ran on another worker process
    assert (d / "quantize.json").stat().st_mtime_ns == runs["quantize_mtime"]  # not recomputed
    assert load(d, "systems.json")["status"] == ("ok" if native.systems_measured(d) else "skipped")
    # no engine of this test's runs (their recipes' seeds 101 and 202 are on each engine's command line)
    # outlived its killed worker; other engines on this machine are not this test's to find
    leftovers = subprocess.run(["pgrep", "-f", "vllm.entrypoints.openai.api_server .*--seed (101|202) "],
                               capture_output=True)
    assert leftovers.returncode == 1, leftovers.stdout
