"""Quantization wall time and peak RAM per scheme on the default model.

    python3 benchmarks/quantize_schemes.py [RECIPE]     (default: recipes/matrix.yaml)

Quantizes every variant of the recipe that has an offline producer (llm-compressor, or
transformers + bitsandbytes), through the pipeline's own quantize stage, with the recipe's
calibration settings, and prints: quantize wall time, peak RSS of the quantizer process,
checkpoint size and bits per weight in effect. Checkpoints land in the pipeline's cache,
so a later run of the recipe reuses them; pass --cold to ignore that cache (figures are
then always freshly measured; a cached checkpoint reports the figures of the run that
made it, marked "cached").
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from pipeline.recipe import schema as recipe_mod
    from pipeline.run import runner
    from pipeline.runstore import hash_obj
    from pipeline.setup import envs, host
    from pipeline.stages import quantize as quantize_stage
    from pipeline.store import keys, provenance
    from pipeline.store.outcome import Spent

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    cold = "--cold" in sys.argv
    recipe = recipe_mod.load(args[0] if args else ROOT / "recipes" / "matrix.yaml")
    runner.prepare_environment()
    model_dir = runner.resolve_model(recipe)
    model_id = hash_obj(provenance.model_hashes(model_dir))
    c = recipe.calibration
    print(f"model {model_dir}, calibration {c.dataset} {c.num_samples}x{c.max_seq_len} tokens, "
          f"dtype {host.resolve_dtype(c.dtype)}, {provenance.hardware().get('cpu')}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for v in recipe.variants:
            if not v.quantized_offline or v.scheme == "custom":
                print(f"{v.name}: no offline quantization ({v.scheme}, kv {v.kv_cache})")
                continue
            vdir = Path(tmp) / v.name
            vdir.mkdir()
            if cold:  # drop this variant's cached checkpoint so the figure is measured now
                key_probe = keys.quantize_key(recipe, v, model_id)
                shutil.rmtree(envs.home() / "checkpoints" / key_probe[:24], ignore_errors=True)
            t0 = time.perf_counter()
            try:
                qr = quantize_stage.quantize(recipe, v, model_dir, model_id, vdir, Spent())
            except Exception as exc:  # one scheme failing must not hide the others' figures
                print(f"{v.name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                continue
            rows.append((v.name, v.scheme + ("" if v.kv_cache == "auto" else f"+kv-{v.kv_cache}"),
                         qr.quantize_wall_s, qr.peak_rss_bytes, qr.checkpoint_bytes,
                         qr.facts.get("bits_per_weight"), qr.cached, time.perf_counter() - t0))
    print("\n== quantization per scheme ==")
    print(f"{'variant':<20} {'scheme':<28} {'wall s':>8} {'peak RSS':>10} {'checkpoint':>11} {'bits/w':>7}")
    for name, scheme, wall, peak, size, bpw, cached, _ in rows:
        print(f"{name:<20} {scheme:<28} {wall:>8.0f} {peak / 2**30:>8.2f} G {size / 2**20:>8.0f} MiB "
              f"{bpw:>7.2f}{'  (cached: figures of the run that made it)' if cached else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
