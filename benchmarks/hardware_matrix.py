"""Every scheme of recipes/matrix.yaml on this machine, at small sizes, recorded as dated rows.

    python3 benchmarks/hardware_matrix.py [--no-write] [--strict] [--no-fp8-model | --fp8-model-only]

Runs the matrix (the default model; PIQA 50 items; 8 requests of 128 + 32 tokens at concurrency
2; 4 x 128 calibration tokens) through `./quantize-eval` in a temporary folder, then its FP8 variants
again on gemma3-270m, whose Linear shapes tile 128x128 FP8 blocks (the default model's 576 does not, so
its FP8 block rows are SKIPPED on every kind for the shape alone); prints one row per scheme
(native / emulated / SKIPPED and why, whether it loaded and served, output tokens/s,
KV tokens, PIQA accuracy) and appends them, stamped with the date, CPU model, ISA flags and the
vLLM build, to docs/measured-hardware.md. Run it on each kind of machine a session lands on
whose rows are missing or stale; the README's support matrix cites these rows. --strict: exit 1 when a
variant failed to run or the reference engine disagrees with it (a SKIPPED variant is an answer, not a failure).
--fp8-model-only: the second pass alone, for a kind whose default-model rows are already recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.engine_env import reexec_under_engine_env  # noqa: E402

reexec_under_engine_env(__file__)
import yaml  # noqa: E402  (the engine environment has it)

DOC = ROOT / "docs" / "measured-hardware.md"
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp8")


FP8_MODEL = "gemma3-270m"  # a builtin model whose every Linear tiles 128x128 blocks


def small_matrix(out: Path, fp8_model: str | None = None) -> Path:
    r = yaml.safe_load((ROOT / "recipes" / "matrix.yaml").read_text())
    r.update(name="hardware-matrix", runs_dir=str(out / "runs"), gates=[], objective="best_quality")
    if fp8_model:  # the FP8 weight and KV schemes only, on a model whose shapes they tile
        r.update(name="hardware-matrix-fp8", model={"builtin": fp8_model})
        # its float32 engine, with a 262k-token vocabulary, holds more before any pool than the matrix's 4 GiB
        # budget leaves it (the engine refuses to start; docs/measured-hardware.md has the figures)
        r["engine"]["memory_budget_gib"] = 6.0
        r["variants"] = [v for v in r["variants"] if v["scheme"].startswith("fp8") or v.get("kv_cache", "auto") != "auto"
                         and v["scheme"] == "none"]
    r["calibration"].update(num_samples=4, max_seq_len=128)
    r["quality"] = {"suites": ["piqa"], "limit": 50}
    r["workload"] = {"prompt_tokens": 128, "output_tokens": 32, "concurrency": 2, "num_requests": 8,
                     "warmup_requests": 1}
    path = out / "hardware-matrix.yaml"
    path.write_text(yaml.safe_dump(r, sort_keys=False))
    return path


def cpu() -> tuple[str, str]:
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    return model, " ".join(f for f in FLAGS if f in flags)


def rows(run: Path) -> list[list[str]]:
    data = json.loads((run / "results.json").read_text())
    out = []
    for name, v in data["variants"].items():
        sup, s, q = v.get("support") or {}, v.get("systems") or {}, v.get("quality") or {}
        err = (v.get("error") or {}).get("error")
        mode = "baseline" if name == "baseline" else {"unsupported": "SKIPPED"}.get(sup.get("mode"), sup.get("mode", "?"))
        lat = s.get("latency") or {}
        piqa = (q.get("suites") or {}).get("piqa") or {}
        served = "yes" if lat.get("completed") else ("quality only" if q.get("status") == "ok" else "no")
        compute = f"{sup['compute']} ({sup.get('activations')})" if sup.get("compute") else "–"
        a = v.get("agreement") or {}
        agrees = ("NO" if a.get("flagged") else "yes") + f" ({a.get('reason', '')[:60]})" if a.get("status") == "ok" \
            else (f"{a['status']}: {str(a.get('error'))[:60]}" if a else "–")
        out.append([name, mode, compute, "FAILED: " + err[:120] if err else served, agrees,
                    f"{lat['output_tok_per_s']:.1f}" if lat.get("output_tok_per_s") else "–",
                    str((s.get("kv") or {}).get("tokens") or "–"),
                    f"{piqa['accuracy']:.3f}" if piqa else "–",
                    (sup.get("reason") or "").replace("|", "/")[:160]])
    return out


def failures(table: list[list[str]]) -> list[str]:
    """Variants that failed to run or that the reference engine disagrees with (rows() columns)."""
    return [r[0] for r in table if r[3].startswith("FAILED") or r[4].startswith(("NO", "failed"))]


def measure(tmp: Path, fp8_model: str | None = None) -> tuple[str, list[list[str]], int] | None:
    """One matrix run: its section's text, its rows and the run's exit code (None when it left no results)."""
    recipe = small_matrix(tmp, fp8_model)
    t0 = time.perf_counter()
    proc = subprocess.run([str(ROOT / "quantize-eval"), str(recipe)], cwd=tmp, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    run = next((tmp / "runs").glob(f"{yaml.safe_load(recipe.read_text())['name']}-2*"), None)
    if run is None or not (run / "results.json").exists():
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        return None
    manifest = json.loads((run / "manifest.json").read_text())
    table = rows(run)
    model, flags = cpu()
    vllm = next((f"{k} {v}" for k, v in manifest["versions"].items() if k.startswith("vllm")), "vllm ?")
    what = (f"FP8 schemes on {fp8_model} (its Linear shapes tile 128x128 blocks)" if fp8_model
            else "every scheme on the default model")
    head = (f"\n## {time.strftime('%Y-%m-%d')}: {model} ({flags}; kind {manifest['hardware'].get('kind', '?')}), {vllm}, "
            f"engine dtype {manifest['engine_dtype']}: {what}\n\n"
            f"`{' '.join(['python3', 'benchmarks/hardware_matrix.py', *sys.argv[1:]])}`, {wall:.0f} s wall, "
            f"exit {proc.returncode}. "
            "PIQA 50 items (±0.13 at 95%: tells broken from working, not small differences).\n\n"
            "| variant | here | computed as | served | second engine agrees | output tok/s | KV tokens | PIQA acc "
            "| engine support says |\n|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join("| " + " | ".join(r) + " |\n" for r in table), table, proc.returncode


def main() -> int:
    if "--no-fp8-model" in sys.argv and "--fp8-model-only" in sys.argv:
        raise SystemExit("hardware_matrix: --no-fp8-model and --fp8-model-only together leave no pass to run")
    write = "--no-write" not in sys.argv
    sections, lost = [], False
    with tempfile.TemporaryDirectory() as tmp:
        passes = [] if "--fp8-model-only" in sys.argv else [None]
        for fp8_model in passes + ([] if "--no-fp8-model" in sys.argv else [FP8_MODEL]):
            got = measure(Path(tmp), fp8_model)
            lost = lost or got is None
            sections += [got] if got else []  # a pass that left no results loses no other pass's rows
    for text, _, _ in sections:
        print(text)
    if write:
        if not DOC.exists():
            DOC.write_text("# Measured hardware\n\nRows appended by `benchmarks/hardware_matrix.py`, one section per "
                           "machine and date: what each scheme of `recipes/matrix.yaml` did on that CPU kind.\n")
        with open(DOC, "a") as f:
            f.write("".join(text for text, _, _ in sections))
        print(f"appended to {DOC}")
    bad = [x for _, table, _ in sections for x in failures(table)]
    codes = [rc for *_, rc in sections]
    if "--strict" in sys.argv and (bad or any(rc not in (0, 1, 4, 5) for rc in codes)):  # any verdict
        print(f"--strict: failed or disagreeing: {', '.join(bad) or 'none'}; quantize-eval exit {codes}")
        return 1
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
