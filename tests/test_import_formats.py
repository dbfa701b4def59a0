"""GPTQ- and AWQ-format checkpoints (as AutoGPTQ / AutoAWQ wrote them) import exactly.

Fixtures are packed with vLLM's own packers (pipeline/store/legacy_formats.py); the dequantizer that
serves them on engines without a 4-bit kernel must give back exactly the quantized values,
and the support matrix must read their configs as 4-bit weight-only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.engines import formats
from pipeline.recipe.schema import RecipeError, check_checkpoint_dir
from pipeline.runstore import weight_bytes
from pipeline.setup import envs
from pipeline.store import legacy_formats
from pipeline.store.checkpoints import facts
from tests import tinymodel

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tinymodel.build(tmp_path_factory.mktemp("import") / "tiny", seed=3)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_legacy_checkpoint_dequantizes_exactly(tiny, tmp_path, fmt):
    import torch
    from safetensors.torch import load_file

    ckpt = tmp_path / f"tiny-{fmt}"
    reference = legacy_formats.write(tiny, ckpt, fmt)
    check_checkpoint_dir(ckpt, Path("import.yaml"), "variants.0.checkpoint")  # accepted as importable
    cfg = json.loads((ckpt / "config.json").read_text())
    assert formats.checkpoint_format(cfg).weights == "wna16"
    f = facts(ckpt, tiny, weight_bytes(ckpt))
    assert f["unquantized_modules"] == ["model.embed_tokens"]
    assert 4 < f["bits_per_weight"] < 16  # packed 4-bit Linears beside a 16-bit embedding

    dense = tmp_path / f"dense-{fmt}"
    envs.run_module("quantize", "pipeline.engines.workers.dequantize_worker", [str(ckpt), str(dense)],
                    tmp_path / "dequantize.log", 600, "dequantization")
    out = load_file(dense / "model.safetensors")
    assert not any(k.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for k in out)
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    for prefix, ref in reference.items():  # the exact products, in float32: a float16 copy would round them
        got = out[prefix + ".weight"]
        assert got.dtype == torch.float32 and got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_not_importable_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "hqq"}}))
    with pytest.raises(RecipeError, match="quant_method is 'hqq'"):
        check_checkpoint_dir(tmp_path, Path("r.yaml"), "variants.0.checkpoint")


def test_make_legacy_then_import_validates(tiny, tmp_path, monkeypatch):
    """The command import.yaml's comment gives, then the recipe itself, from a clean folder."""
    import shutil
    import subprocess
    import sys

    from pipeline.recipe.schema import load

    root = Path(__file__).resolve().parent.parent
    env = {**__import__("os").environ, "PYTHONPATH": str(root)}
    for fmt in ("gptq", "awq"):
        out = tmp_path / "imports" / f"smollm2-{fmt}"
        p = subprocess.run([sys.executable, "-m", "pipeline.cli", "make-legacy", str(tiny), str(out),
                            "--format", fmt], capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == fmt
    again = subprocess.run([sys.executable, "-m", "pipeline.cli", "make-legacy", str(tiny), str(out),
                            "--format", "awq"], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 2 and "already holds a checkpoint" in again.stderr
    shutil.copy(root / "recipes" / "import.yaml", tmp_path / "import.yaml")
    monkeypatch.chdir(tmp_path)
    assert [v.scheme for v in load(tmp_path / "import.yaml").variants] == ["import", "import"]
