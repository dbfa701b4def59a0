"""The Ray executor on a real multi-node cluster on this machine (Ray's own ray.cluster_utils.Cluster),
with the node running a stage removed mid-stage.

The head node has no CPUs, so every task runs on worker nodes. While the baseline's evaluation has an
engine up on the first worker node, that node is removed (its raylet, workers, stage process and
engine die with it) and a second worker node joins. Ray retries the task there; the stages that had
not finished are measured again, nothing of a lost process is left behind, and the run signs off
complete, each systems result naming the host it was measured on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from pipeline.setup import envs
from tests import native, tinymodel

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent


def _on_node(pid: int, node) -> bool:
    """Does this process run under the node's raylet (its workers are the raylet's children)?"""
    raylet = node.all_processes["raylet"][0].process.pid
    try:
        return any(p.pid == raylet for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    envs.ensure_extra("ray")
    from ray.cluster_utils import Cluster

    tmp = tmp_path_factory.mktemp("cluster")
    model = tinymodel.build(tmp / "tiny", seed=int.from_bytes(os.urandom(2), "little"))  # cold caches
    recipe = {"schema_version": 1, "name": "cluster", "model": {"path": str(model)},
              "engine": {"max_model_len": 512, "max_num_seqs": 8, "kv_cache_gib": 0.25, "dtype": "float32"},
              "calibration": {"num_samples": 4, "max_seq_len": 64},
              "variants": [native.eight_bit_variant(model, "q")],
              "quality": {"suites": ["piqa"], "limit": 10, "bootstrap_samples": 200, "agreement_sample": 0},
              "workload": {"prompt_tokens": 32, "output_tokens": 8, "concurrency": 2, "num_requests": 4,
                           "warmup_requests": 1, "repeats": 1},
              "gates": [{"metric": "accuracy_delta", "op": ">=", "threshold": -1.0}],
              "executor": {"kind": "ray", "cpus_per_variant": 2, "quantize_cpus": 2, "max_retries": 2},
              "runs_dir": str(tmp / "runs")}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    first = cluster.add_node(num_cpus=2, resources={"quantize_eval_host": 1})
    cluster.wait_for_nodes()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_DEDUP_LOGS": "0"}
    log = open(tmp / "driver.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", str(path), "--ray", cluster.address],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=env, start_new_session=True)
    removed = None
    deadline = time.time() + 1500
    try:
        while proc.poll() is None and time.time() < deadline:
            dirs = sorted((tmp / "runs").glob("cluster-*")) if (tmp / "runs").exists() else []
            base = dirs[-1] / "baseline" if dirs else None
            if removed is None and base and (base / "engine.log").exists() and \
                    "Starting to load model" in (base / "engine.log").read_text():
                worker = int((base / ".ray-evaluate.pid").read_text().split()[0])
                assert _on_node(worker, first)  # the head has no CPUs: it ran on the first worker node
                engine_pgid = int((base / "engine.pgid").read_text().split()[0])
                cluster.remove_node(first, allow_graceful=False)
                removed = {"worker": worker, "engine_pgid": engine_pgid}
                # a replacement joins; the retried task runs there
                cluster.add_node(num_cpus=2, resources={"quantize_eval_host": 1})
            time.sleep(1)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        yield {"proc": proc, "removed": removed, "dir": sorted((tmp / "runs").glob("cluster-*"))[-1],
               "log": (tmp / "driver.log").read_text()}
    finally:
        cluster.shutdown()


def load(d: Path, *parts):
    return json.loads(d.joinpath(*parts).read_text())


def test_a_node_removed_mid_stage_is_retried_elsewhere_and_the_run_completes(cluster_run):
    r = cluster_run
    assert r["removed"] is not None, r["log"][-3000:]
    assert r["proc"].returncode in (0, 1), r["log"][-3000:]  # a verdict, not a crash
    so = load(r["dir"], "signoff.json")
    assert [v["variant"] for v in so["variants"]] == ["q"] and so["variants"][0]["verdict"] != "FAILED-TO-RUN"
    for name in ("baseline", "q"):
        assert load(r["dir"], name, "quality.json")["status"] == "ok"
        s = load(r["dir"], name, "systems.json")
        if not native.systems_measured(r["dir"] / name):  # served emulated (AVX2): systems say why not
            assert s["status"] == "skipped" and s["error"]
            continue
        assert s["status"] == "ok" and s["host"] and s["latency"]["completed"] == 4
    # the baseline's evaluation ran again in another worker (on the replacement node), and finished there
    retried = int((r["dir"] / "baseline" / ".ray-evaluate.pid").read_text().split()[0])
    assert retried != r["removed"]["worker"]
    acc = [json.loads(x) for x in (r["dir"] / "stage-accounting.jsonl").read_text().splitlines()]
    assert any(a["variant"] == "baseline" and a["stage"] == "evaluate" for a in acc)
    # nothing of the removed node's stage is left running: its worker and its engine's process group
    assert not psutil.pid_exists(r["removed"]["worker"])
    with pytest.raises(ProcessLookupError):
        os.killpg(r["removed"]["engine_pgid"], 0)
    html = (r["dir"] / "report.html").read_text()
    assert "NO VERDICT" not in html and f"VERDICT: {so['verdict']}" in html
