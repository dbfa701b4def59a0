"""A quality-only run served by the reference engine (engine.kind: transformers): what a user runs where vLLM
cannot serve a scheme (FP8 weights on a CPU without AVX-512). Every engine kind provides the interface."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.engines import interface
from tests import tinymodel

ROOT = Path(__file__).resolve().parent.parent


def test_every_engine_kind_provides_the_interface():
    members = [m for m in vars(interface.EngineKind) if not m.startswith("_")]
    assert "systems_not_measured" in members and "decide" in members
    for name in interface.kinds():
        kind = interface.kind(name)
        missing = [m for m in members if not callable(getattr(kind, m, None))]
        assert not missing, f"engine kind {name} lacks {missing}"
    assert interface.kind("vllm").systems_not_measured() is None
    assert "no memory, capacity or latency" in interface.kind("transformers").systems_not_measured()


@pytest.mark.integration
def test_a_quality_only_run_on_the_reference_engine(tmp_path):
    # its shapes tile FP8's 128x128 blocks; a new seed each time, so nothing comes from the result cache
    model = tinymodel.build(tmp_path / "tiny", seed=int.from_bytes(os.urandom(2), "little"))
    recipe = {
        "schema_version": 1, "name": "ref", "model": {"path": str(model)},
        "engine": {"kind": "transformers", "max_model_len": 512, "max_num_seqs": 4, "dtype": "float32"},
        "calibration": {"num_samples": 4, "max_seq_len": 64},
        "variants": [{"name": "fp8b", "scheme": "fp8_block"}, {"name": "kvfp8", "scheme": "none", "kv_cache": "fp8"},
                     {"name": "gptq", "scheme": "import", "checkpoint": "example:gptq"}],
        "quality": {"suites": ["piqa", "drift"], "limit": 6, "bootstrap_samples": 100,
                    "drift": {"windows": 4, "window_tokens": 64}},
        "gates": [{"metric": "accuracy_delta", "op": ">=", "threshold": -0.05},
                  {"metric": "tpot_p99_ratio", "op": "<=", "threshold": 1.2}],
        "runs_dir": str(tmp_path / "runs"),
    }
    path = tmp_path / "ref.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    check = subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", str(path)], capture_output=True,
                           text=True, cwd=tmp_path, env=env, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    assert "memory: budget" not in check.stdout  # no pool to predict: the engine sizes none
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", str(path)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=1200)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-3000:]
    assert proc.returncode != 0  # a latency gate it cannot measure is UNVERIFIED: never a pass
    run = next((tmp_path / "runs").glob("ref-*"))
    why = interface.kind("transformers").systems_not_measured()
    for name in ("baseline", "fp8b"):
        s = json.loads((run / name / "systems.json").read_text())
        assert s["status"] == "skipped" and s["error"] == why, s
        assert json.loads((run / name / "agreement.json").read_text())["status"] == "skipped"
        assert "reference engine: loading" in (run / name / "engine.log").read_text()  # never vLLM
    assert json.loads((run / "fp8b" / "quality.json").read_text())["status"] == "ok"
    # it loads the FP8 checkpoint itself, not a dense copy
    checkpoint = json.loads((run / "fp8b" / "quantize.json").read_text())["checkpoint_dir"]
    assert f"reference engine: loading {checkpoint} with" in (run / "fp8b" / "engine.log").read_text()

    def lls(name: str) -> list[list[float]]:
        return [json.loads(line)["loglikelihoods"] for line in (run / name / "samples" / "piqa.jsonl").open()]

    moved = max(abs(a - b) for x, y in zip(lls("baseline"), lls("fp8b"), strict=True) for a, b in zip(x, y, strict=True))
    assert moved > 1e-4  # the FP8 weights were computed, not the dense ones
    support = json.loads((run / "kvfp8" / "support.json").read_text())
    assert support["mode"] == "unsupported" and "FP8 KV" in support["reason"]
    support = json.loads((run / "gptq" / "support.json").read_text())  # refused before its engine starts
    assert support["mode"] == "unsupported" and "GPTQ/AWQ-format" in support["reason"]
    # drift reads top-k log-probabilities by token id: the reference engine serves them as vLLM does
    assert json.loads((run / "fp8b" / "quality.json").read_text())["drift"]["top_k"] == 20
    signoff = json.loads((run / "signoff.json").read_text())
    fp8b = next(v for v in signoff["variants"] if v["variant"] == "fp8b")
    gate = next(g for g in fp8b["gates"] if g["metric"] == "tpot_p99_ratio")
    assert gate["outcome"] == "N/A" and "not measurable" in gate["note"] and fp8b["verdict"] == "UNVERIFIED", fp8b
    assert fp8b["drift"]["kl_mean"] > 0 and 0 < fp8b["drift"]["top1_agreement"] <= 1  # paired over the top-k
    report = (run / "report.html").read_text()
    assert f"served by transformers, quality only: {why}" in report


def test_a_variant_the_serving_engine_skips_names_the_engine_that_scores_its_quality(tmp_path, capsys):
    from types import SimpleNamespace

    from pipeline.engines.formats import Decision, Format
    from pipeline.run import runner

    refuses = SimpleNamespace(decide=lambda fmt, cfg, dtype, activations: Decision("unsupported", "cpu", "no FP8 here"),
                              numerics_env=lambda compute: {}, native_on=lambda w: "elsewhere")
    ctx = SimpleNamespace(engine=refuses, recipe=SimpleNamespace(engine=SimpleNamespace(kind="vllm")), dtype="float32")
    v = SimpleNamespace(name="fp8", activations="auto")
    runner._judge(ctx, v, tmp_path, Format("fp8_block", False, "scheme fp8_block"), {})
    assert "SKIPPED: no FP8 here (its quality alone: engine.kind transformers)" in capsys.readouterr().out
    runner._judge(ctx, v, tmp_path, Format("fp8_block", True, "scheme fp8_block, kv fp8"), {})
    assert capsys.readouterr().out.rstrip().endswith("SKIPPED: no FP8 here")  # nor can the reference: no hint


def test_results_served_by_the_reference_engine_are_keyed_by_its_code():
    from pipeline.recipe.schema import Recipe
    from pipeline.store import keys

    def common(kind: str) -> dict:
        r = Recipe.model_validate({"schema_version": 1, "name": "x", "model": {"builtin": "smollm2-135m-instruct"},
                                   "engine": {"kind": kind}, "variants": [{"name": "v", "scheme": "w8a8_int8"}]})
        return keys._common(r, "w", "float32", {}, None)["engine"]

    served = common("transformers")["code"]
    assert served == keys.source_hash(*sorted((keys.PIPELINE / "engines" / "transformers").rglob("*.py")))
    assert "code" not in common("vllm")  # vLLM's code is in every key already (keys.ENGINE_SIDE)
