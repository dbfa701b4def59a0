"""Result-cache keys: what measures is part of the key, so a fix to a measurement recomputes
exactly the results it measured, and nothing else."""

from __future__ import annotations

import shutil

from pipeline.store import keys
from tests.minirun import recipe


def test_a_change_to_measuring_code_invalidates_exactly_its_results(tmp_path, monkeypatch):
    r = recipe([])
    monkeypatch.setattr(keys, "_common", lambda *a: {"weights": "w"})  # no engine or hardware is asked
    copies = {}
    for name, files in (("QUALITY_CODE", keys.QUALITY_CODE), ("SYSTEMS_CODE", keys.SYSTEMS_CODE)):
        own = tmp_path / name
        own.mkdir()
        copied = []
        for f in files:
            dst = own / f"{len(copied)}-{f.name}"
            shutil.copy(f, dst)
            copied.append(dst)
        copies[name] = copied
        monkeypatch.setattr(keys, name, tuple(copied))
    q0, s0 = keys.evaluate_keys(r, "w", "float32", [])
    assert keys.evaluate_keys(r, "w", "float32", []) == (q0, s0)  # stable
    with open(copies["QUALITY_CODE"][0], "a") as f:  # a fix to the quality stage
        f.write("\n# scoring fixed\n")
    q1, s1 = keys.evaluate_keys(r, "w", "float32", [])
    assert q1 != q0 and s1 == s0
    with open(copies["SYSTEMS_CODE"][-1], "a") as f:  # a change to engine-side code changes what both measure
        f.write("\n# engine-side hook changed\n")
    q2, s2 = keys.evaluate_keys(r, "w", "float32", [])
    assert s2 != s1 and q2 == q1  # (the copies are separate: each stage's own fingerprint moved alone)


def test_the_fingerprints_name_the_files_that_measure():
    names = {p.name for p in keys.QUALITY_CODE}
    assert {"quality.py", "qe_utils.py", "server.py", "sitecustomize.py"} <= names
    assert {"systems.py", "admission.py", "loadgen.py", "server.py"} <= {p.name for p in keys.SYSTEMS_CODE}
    assert all(p.exists() for p in (*keys.QUALITY_CODE, *keys.SYSTEMS_CODE, keys.QUANTIZE_WORKER,
                                    keys.DEQUANTIZE_WORKER, keys.SCHEMES))  # a moved file would drop out unseen


def test_the_fingerprints_follow_every_import_of_the_measuring_code():
    """The modules a review found outside the hand-kept lists (edited, no key moved) are in both now."""
    for code in (keys.QUALITY_CODE, keys.SYSTEMS_CODE):
        rel = {str(p.relative_to(keys.ROOT)) for p in code}
        assert {"pipeline/measure/stats.py", "pipeline/stages/evaluate.py", "pipeline/setup/modelcfg.py"} <= rel
    assert "pipeline/measure/membudget.py" in {str(p.relative_to(keys.ROOT)) for p in keys.SYSTEMS_CODE}


def test_an_import_planted_anywhere_in_the_closure_moves_the_key(tmp_path):
    """A module imported (at any depth, even inside a function) by a stage's code is part of its key."""
    pkg = tmp_path / "pipeline"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "stage.py").write_text("from pipeline import helper\n")
    (pkg / "helper.py").write_text("import json\n\ndef f():\n    return 1\n")
    (pkg / "deep.py").write_text("X = 1\n")
    closure = lambda: keys.import_closure(pkg / "stage.py", root=tmp_path)  # noqa: E731
    assert [p.name for p in closure()] == ["__init__.py", "helper.py", "stage.py"]
    before = keys.source_hash(*closure())
    (pkg / "helper.py").write_text("import json\n\ndef f():\n    from pipeline.deep import X\n    return X\n")
    assert [p.name for p in closure()] == ["__init__.py", "deep.py", "helper.py", "stage.py"]
    planted = keys.source_hash(*closure())
    (pkg / "deep.py").write_text("X = 2\n")  # a fix deep in the closure
    assert len({before, planted, keys.source_hash(*closure())}) == 3


def test_every_source_file_a_module_names_exists():
    """A module that names a file by path (a worker it launches, code that keys a result) must name one
    that exists: a file moved without its path updated fails a run only after its earlier stages spent
    their time (the search's sensitivity key once named workers at their old place)."""
    import importlib
    import pkgutil
    from pathlib import Path

    import pipeline

    named = {}
    for info in pkgutil.walk_packages(pipeline.__path__, "pipeline."):
        if ".workers." in info.name or info.name.endswith(("__main__", "sitecustomize")):
            continue  # workers run in the quantize environment; hooks are imported by the engine itself
        mod = importlib.import_module(info.name)
        for attr, value in vars(mod).items():
            for v in value if isinstance(value, tuple | list) else (value,):
                if isinstance(v, Path) and v.suffix == ".py":
                    named[f"{info.name}.{attr}"] = v
    assert "pipeline.stages.sensitivity.CODE" in named and "pipeline.store.keys.QUALITY_CODE" in named
    missing = {k: str(v) for k, v in named.items() if not v.exists()}
    assert not missing, missing


def test_the_engine_environment_that_changes_numerics_keys_every_result():
    """The same checkpoint computed as W4A8 (VLLM_CPU_INT4_W4A8=1) is another quality and systems result;
    None is the default every engine gets, so it keys the same as asking for it."""
    from pipeline.engines.vllm.server import numerics_env

    r = recipe([])
    default = keys.evaluate_keys(r, "w", "bfloat16", [])
    assert keys.evaluate_keys(r, "w", "bfloat16", [], numerics=numerics_env("W4A16")) == default
    w4a8 = keys.evaluate_keys(r, "w", "bfloat16", [], numerics=numerics_env("W4A8"))
    assert w4a8[0] != default[0] and w4a8[1] != default[1]


def test_a_vllm_variable_in_the_users_shell_keys_the_results(monkeypatch):
    """VLLM_CPU_ATTN_SPLIT_KV=0 reorders attention sums: a result measured with it is another result, and
    provenance shows it; the variables the pipeline sets itself are not the user's."""
    import os

    from pipeline.engines.vllm.server import numerics_env

    for k in [k for k in os.environ if k.startswith("VLLM_")]:
        monkeypatch.delenv(k)
    r = recipe([])
    default = keys.evaluate_keys(r, "w", "float32", [])
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", "0")
    monkeypatch.setenv("VLLM_HOST_IP", "10.0.0.9")
    assert numerics_env() == {"VLLM_CPU_ATTN_SPLIT_KV": "0", "VLLM_CPU_INT4_W4A8": "0"}
    assert keys.evaluate_keys(r, "w", "float32", []) != default
