"""Kill a real run with SIGKILL at several points; the same command resumes and finishes.

Nothing finished is recomputed (result files keep their bytes and mtimes), nothing
half-written is trusted, and no engine process outlives the run that started it.
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

from tests import tinymodel

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent


def engines_of(cwd: Path) -> list[psutil.Process]:
    """vLLM processes started by this test's runs, known by their working folder (the runs' own): the
    engine core renames itself (VLLM::EngineCore), which also overwrites what /proc shows of its
    command line and environment, and other runs' engines on this machine are not this test's to find."""
    out = []
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            if "vllm" in " ".join(p.info["cmdline"] or []).lower() or "VLLM" in (p.info["name"] or ""):
                if Path(p.cwd()) == cwd:
                    out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _interactive() -> None:
    # as a terminal would: a runner started in the background by a non-interactive shell inherits
    # SIGINT ignored (POSIX), and Python then never raises KeyboardInterrupt for Ctrl-C
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cmd, cwd, env) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=_interactive)


def kill_when(proc: subprocess.Popen, root: Path, pattern: str, timeout: float = 900) -> None:
    """SIGKILL the run's whole process group as soon as root.glob(pattern) matches."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if root.exists() and list(root.glob(pattern)):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            return
        if proc.poll() is not None:
            raise AssertionError("run ended before the kill point: " + proc.stdout.read()[-2000:])
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"kill point {pattern} never reached")


def test_sigkill_at_several_points_then_resume(tmp_path):
    model = tinymodel.build(tmp_path / "tiny", seed=int.from_bytes(os.urandom(2), "little"))
    recipe = {
        "schema_version": 1, "name": "killme", "model": {"path": str(model)},
        "engine": {"max_model_len": 256, "max_num_seqs": 4, "kv_cache_gib": 0.125},
        "calibration": {"num_samples": 2, "max_seq_len": 32},
        "variants": [{"name": "rtn", "scheme": "rtn_w4a16", "group_size": 64}],
        "quality": {"suites": ["piqa"], "limit": 8, "bootstrap_samples": 100, "agreement_sample": 0},
        "workload": {"prompt_tokens": 16, "output_tokens": 4, "concurrency": 1, "num_requests": 2,
                     "warmup_requests": 0, "repeats": 1},
        "runs_dir": str(tmp_path / "runs"),
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "pipeline.cli", str(tmp_path / "r.yaml")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    # 1: killed mid-evaluation of the baseline, after quality was written, before systems
    p = start(cmd, tmp_path, env)
    kill_when(p, tmp_path / "runs", "killme-*/baseline/quality.json")
    run_dir = next((tmp_path / "runs").glob("killme-*"))
    quality = run_dir / "baseline" / "quality.json"
    before = (quality.read_bytes(), quality.stat().st_mtime_ns)
    time.sleep(3)
    assert not engines_of(tmp_path), "an engine outlived the SIGKILLed run"

    # 2: killed while the variant quantizes
    p = start(cmd, tmp_path, env)
    kill_when(p, run_dir, "rtn/quantize-spec.json")
    assert (quality.read_bytes(), quality.stat().st_mtime_ns) == before
    assert (run_dir / "baseline" / "systems.json").exists()
    assert not (run_dir / "rtn" / "quantize.json").exists()

    # 3: runs to the end
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"resuming: {run_dir}" in done.stdout
    assert "baseline | evaluate: done earlier" in done.stdout
    assert (quality.read_bytes(), quality.stat().st_mtime_ns) == before
    so = json.loads((run_dir / "signoff.json").read_text())
    assert so["variants"][0]["verdict"] in ("PASS", "WARN")
    assert not list((run_dir.parent).glob("killme-*"))[1:], "a second run folder was created"
    time.sleep(2)
    assert not engines_of(tmp_path)

    # 4: a variant that fails (its quantization times out) ends FAILED-TO-RUN; the others
    # keep their results and the run exits 1. No engine is needed for any of it.
    ckpts = Path(env.get("QUANTIZE_EVAL_HOME", Path.home() / ".cache" / "quantize-eval")) / "checkpoints"
    tmps_before = set(ckpts.glob("*.tmp*"))  # the shared cache may hold other killed runs' leftovers
    recipe["variants"].append({"name": "gptq", "scheme": "gptq_w4a16", "group_size": 64})
    recipe["calibration"]["timeout_s"] = 0.5  # not part of the checkpoint key: rtn stays cached
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    bad = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1, bad.stdout[-3000:]
    assert "gptq | FAILED-TO-RUN: RuntimeError: quantization timed out after" in bad.stdout
    assert "starting engine" not in bad.stdout
    so = json.loads((run_dir / "signoff.json").read_text())
    verdicts = {v["variant"]: v["verdict"] for v in so["variants"]}
    assert verdicts["gptq"] == "FAILED-TO-RUN" and verdicts["rtn"] in ("PASS", "WARN")
    assert "FAILED-TO-RUN" in (run_dir / "report.html").read_text()
    assert not set(ckpts.glob("*.tmp*")) - tmps_before, "this run left a half-written checkpoint"

    # 5: changing only the workload re-measures systems and nothing else; with two engine starts, each
    # measures the primary cell again and latency is judged across them
    recipe["variants"].pop()
    recipe["calibration"].pop("timeout_s")
    recipe["workload"]["num_requests"] = 3
    recipe["workload"]["engine_starts"] = 2
    recipe["gates"] = [{"metric": "tpot_p50_ratio", "op": "<=", "threshold": 100.0, "severity": "warn"}]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "baseline | evaluate: starting engine (systems)" in again.stdout
    assert "quantize: done earlier" in again.stdout
    assert (quality.read_bytes(), quality.stat().st_mtime_ns) == before
    base_sys = json.loads((run_dir / "baseline" / "systems.json").read_text())
    assert base_sys["latency"]["completed"] == 3  # the summary is the first start's
    assert [r["start"] for r in base_sys["latency"]["repeats"]] == [0, 1]
    assert "baseline | engine start 2/2 ready" in again.stdout and (run_dir / "baseline" / "engine-start2.log").exists()
    gate = json.loads((run_dir / "signoff.json").read_text())["variants"][0]["gates"][0]
    if json.loads((run_dir / "rtn" / "systems.json").read_text())["status"] == "ok":  # native on this kind
        assert gate["measured"]["n_of"] == "workload.engine_starts" and gate["measured"]["n"] == 2, gate
    time.sleep(2)
    assert not engines_of(tmp_path), "a further engine start outlived its measurement"

    # 6: Ctrl-C (SIGINT) while an engine serves: exit 130, finished work kept, engine reaped
    recipe["workload"]["num_requests"] = 5
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    p = start(cmd, tmp_path, env)
    deadline = time.time() + 600
    while not (run_dir / "baseline" / "engine.pgid").exists():
        assert p.poll() is None and time.time() < deadline, "engine never started"
        time.sleep(0.5)
    time.sleep(5)
    os.killpg(p.pid, signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 130, out[-2000:]
    assert "interrupted: finished stages are kept" in out
    assert not (run_dir / "baseline" / "engine.pgid").exists()
    time.sleep(2)
    assert not engines_of(tmp_path), "an engine outlived Ctrl-C"
    assert (quality.read_bytes(), quality.stat().st_mtime_ns) == before
