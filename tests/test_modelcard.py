"""The model-card table: the published cards' columns, from the run's paired results, and what they lack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipeline.runstore import write_json
from pipeline.stages.signoff import signoff
from reports.modelcard import write_model_card
from tests.minirun import load_results, make_run, recipe

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path):
    r = recipe([{"metric": "accuracy_delta", "op": ">=", "threshold": -0.05}])
    # arc_challenge: 80 -> 72 right (10 right answers lost, 2 gained); piqa: the same 60 of 100 both ways, yet
    # 6 answers changed each way (recovery 100.0%, the flips the card alone would hide)
    base = {"arc_challenge": [1] * 80 + [0] * 20, "piqa": [1] * 60 + [0] * 40}
    var = {"arc_challenge": [0] * 10 + [1] * 70 + [1] * 2 + [0] * 18,
           "piqa": [0] * 6 + [1] * 54 + [1] * 6 + [0] * 34}
    root = make_run(tmp_path / "run", r, base, var)
    q = json.loads((root / "baseline" / "quality.json").read_text())  # as the quality stage records them
    q["settings"]["num_fewshot"], q["suites"]["arc_challenge"]["metric"] = 0, "acc_norm"
    write_json(root / "baseline" / "quality.json", q)
    write_json(root / "signoff.json", signoff(r, "h", root, load_results(root)))
    return root


def _rows(md: str) -> dict[str, list[str]]:
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in md.splitlines() if line.startswith("| ")]
    return {r[0]: r for r in rows}


def test_the_table_has_the_cards_columns_and_the_paired_ones(tmp_path):
    root = _run(tmp_path)
    md = write_model_card(root).read_text()
    rows = _rows(md)
    assert rows["Task"][:6] == ["Task", "Metric", "n", "Baseline", "v4", "Recovery"]
    arc = rows["ARC-Challenge"]
    assert arc[1:6] == ["acc_norm, 0-shot", "100", "80.00", "72.00", "90.0%"]
    assert arc[6].startswith("−8.00 [") and arc[7] == "10 / 2"
    piqa = rows["PIQA"]
    assert piqa[3:6] == ["60.00", "60.00", "100.0%"] and piqa[6].startswith("+0.00 [") and piqa[7] == "6 / 6"
    pooled = rows["All scored items, pooled"]
    assert pooled[2:6] == ["200", "70.00", "66.00", "94.3%"] and pooled[7] == "16 / 8"
    lo, hi = (float(x.replace("−", "-")) for x in arc[6].split("[")[1].rstrip("]").split(", "))
    assert lo < -8.0 < hi < 0  # the interval is the signoff's, around the paired difference
    verdict = json.loads((root / "signoff.json").read_text())["variants"][0]["verdict"]
    assert f"## v4 (rtn_w4a16): {verdict}" in md.splitlines()
    assert "ARC-Challenge †" not in rows and "a loss cannot show here" in md


def test_report_writes_it_from_the_command_line(tmp_path):
    root = _run(tmp_path)
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "report", str(root), "--model-card"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == str(root / "model-card.md") and (root / "model-card.md").exists()
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "report", str(tmp_path / "nope"), "--model-card"],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "run folder not found" in p.stderr and "Traceback" not in p.stderr


def test_long_context_retrieval_is_shown_by_length_under_its_task(tmp_path):
    """The needle task's rows by haystack length, shortest first, each with its own paired interval: the
    card says where retrieval breaks, not only that the average moved."""
    r = recipe([{"metric": "accuracy_delta", "op": ">=", "threshold": -0.05}])
    lengths = ["1792 tok", "256 tok", "1024 tok"] * 20  # items interleaved by length, as the suite builds them
    base = {"needle": [1] * 60, "piqa": [1] * 60 + [0] * 40}
    var = {"needle": [0 if x == "1792 tok" else 1 for x in lengths], "piqa": base["piqa"]}
    root = make_run(tmp_path / "run", r, base, var)
    for name in ("baseline", "v4"):
        path = root / name / "samples" / "needle.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        for x in rows:
            x["slices"] = {"context": lengths[x["doc_id"]]}
        path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    write_json(root / "signoff.json", signoff(r, "h", root, load_results(root)))
    md = write_model_card(root).read_text()
    names = [line.strip("|").split(" | ")[0].strip() for line in md.splitlines() if line.startswith("| ")]
    at = names.index("Needle in a haystack")
    assert names[at + 1:at + 4] == ["↳ 256 tok context", "↳ 1024 tok context", "↳ 1792 tok context"]
    rows = _rows(md)
    assert rows["↳ 1792 tok context"][2:6] == ["20", "100.00", "0.00", "0.0%"]
    assert rows["↳ 256 tok context"][5] == "100.0%" and rows["Needle in a haystack"][2] == "60"
