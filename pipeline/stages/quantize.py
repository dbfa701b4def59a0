"""The quantize stage: a variant's weights, quantized, imported or dequantized for emulation.

    quantize          llm-compressor (or transformers) in the quantize environment, as a subprocess;
                      checkpoints cached under $QUANTIZE_EVAL_HOME/checkpoints by keys.quantize_key
    import_checkpoint an existing GPTQ / AWQ / compressed-tensors checkpoint, facts recorded
    dense_copy        exactly the quantized values as dense weights, for engines without the kernel

Every folder is written whole or not at all (runstore.atomic_dir); a killed run's half-written
folders are swept by the next writer of the same key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.engines.workers.quantize_worker import build_recipe
from pipeline.progress import say
from pipeline.recipe.files import EXAMPLE
from pipeline.results import QuantizeResult
from pipeline.runstore import atomic_dir, hash_obj, read_result, weight_bytes, write_json
from pipeline.schemes import SCHEMES, W4_SCHEMES
from pipeline.setup import assets, envs, host
from pipeline.store import checkpoints, keys, provenance

NOISE = ("No accelerator available",)


def _spec(recipe, v, model_dir: Path, out: Path, dense_out: Path | None) -> dict:
    """What the quantize worker is asked to do (quantize-spec.json)."""
    spec = {"model_dir": str(model_dir), "out_dir": str(out), "scheme": v.scheme,
            "group_size": v.group_size, "ignore": list(v.ignore), "kv_cache": v.kv_cache,
            "smoothing_strength": v.smoothing_strength,
            "recipe_file": str(Path(v.recipe).resolve()) if v.recipe else None,
            "calibration_file": str(assets.calibration_text(recipe.calibration.dataset)),
            "num_samples": recipe.calibration.num_samples, "max_seq_len": recipe.calibration.max_seq_len,
            "seed": recipe.engine.seed, "trust_remote_code": recipe.model.trust_remote_code,
            "calibration_dtype": host.resolve_dtype(recipe.calibration.dtype)}
    if dense_out is not None:
        spec["dense_out"] = str(dense_out)
    return spec


def _describe(recipe, v) -> str:
    what = v.scheme + (f" g{v.group_size or 'channel'}" if v.scheme in W4_SCHEMES else "") + (
        f" + kv {v.kv_cache}" if v.kv_cache != "auto" else "") + (f" ({v.recipe})" if v.recipe else "")
    return f"{what} on {recipe.calibration.num_samples}x{recipe.calibration.max_seq_len} calibration tokens"


# llm-compressor's sequential pipeline draws "(3/31): Calibrating" bars, one subgraph (a decoder layer)
# at a time, one pass per calibrating modifier (SmoothQuant then GPTQ: two); data-free schemes (RTN,
# FP8) have no calibration to count
PROGRESS = r"\((\d+)/(\d+)\): (?:Calibrating|Propagating)"
CALIBRATING = ("SmoothQuantModifier", "AWQModifier", "GPTQModifier")


def _passes(spec: dict) -> int:
    if spec.get("recipe_file"):
        text = Path(spec["recipe_file"]).read_text()
    elif SCHEMES[spec["scheme"]].producer == "llm-compressor":
        text = json.dumps(build_recipe(spec))
    else:
        text = ""
    return max(1, sum(text.count(m) for m in CALIBRATING))


def _build(recipe, v, model_dir: Path, vdir: Path, ckpt: Path, also_dense: bool, spent) -> dict:
    """Run the worker into fresh folders (the checkpoint, and its dense copy when the engine will
    need one: written while the worker is up); the worker's facts."""
    with atomic_dir(ckpt) as tmp, atomic_dir(dense_path(ckpt)) as dense_tmp:
        spec = _spec(recipe, v, model_dir, tmp, dense_tmp if also_dense else None)
        (vdir / "quantize-spec.json").write_text(json.dumps(spec, indent=2))
        say(v.name, f"quantize: {_describe(recipe, v)}")
        (vdir / "quantize-worker.json").unlink(missing_ok=True)
        envs.run_quantize_env("pipeline.engines.workers.quantize_worker",
                              [str(vdir / "quantize-spec.json"), str(vdir / "quantize-worker.json")],
                              vdir / "quantize.log", recipe.calibration.timeout_s, "quantization", spent,
                              hint=" (calibration.timeout_s)", label=v.name, unit="subgraphs",
                              count_pattern=PROGRESS, count_passes=_passes(spec), progress_bars=True)
        if not (vdir / "quantize-worker.json").exists():
            raise RuntimeError(f"quantization wrote no result; log: {vdir / 'quantize.log'}")
        facts = json.loads((vdir / "quantize-worker.json").read_text())
        facts["warnings"] = _warnings(vdir / "quantize.log")
        write_json(tmp / "qe-checkpoint.json", facts)
        if not (dense_tmp / "config.json").exists():  # no complete dense copy: publish none
            shutil.rmtree(dense_tmp)
            dense_tmp.mkdir()
    return facts


def quantize(recipe, v, model_dir: Path, model_hash: str, vdir: Path, spent,
             also_dense: bool = False) -> QuantizeResult:
    key = keys.quantize_key(recipe, v, model_hash)
    done = read_result(vdir / "quantize.json", QuantizeResult, key)
    if done and done.status == "ok" and Path(done.checkpoint_dir, "qe-checkpoint.json").exists():
        say(v.name, f"quantize: done earlier ({done.checkpoint_dir})")
        return done
    ckpt = envs.home() / "checkpoints" / key[:24]
    cached = (ckpt / "qe-checkpoint.json").exists()
    if cached:
        say(v.name, f"quantize: cached checkpoint {ckpt}")
        facts = json.loads((ckpt / "qe-checkpoint.json").read_text())
    else:
        facts = _build(recipe, v, model_dir, vdir, ckpt, also_dense, spent)
    cfg = json.loads((ckpt / "config.json").read_text()).get("quantization_config", {})
    size = weight_bytes(ckpt)
    result = QuantizeResult(
        variant=v.name, input_hash=key, status="ok", duration_s=facts["wall_s"], scheme=v.scheme,
        checkpoint_dir=str(ckpt), checkpoint_bytes=size, cache_key=key[:24], cached=cached,
        facts=checkpoints.facts(ckpt, model_dir, size),
        peak_rss_bytes=facts["peak_rss_bytes"], quantize_wall_s=facts["wall_s"],
        llmcompressor_recipe=facts["recipe"],
        ignored_modules=list(cfg.get("ignore") or cfg.get("llm_int8_skip_modules") or []),
        warnings=facts.get("warnings", []), versions=facts["versions"])
    write_json(vdir / "quantize.json", result)
    say(v.name, f"quantize: {result.checkpoint_bytes / 2**20:.0f} MiB, {result.facts['bits_per_weight']} bits/weight "
                f"in effect, in {result.quantize_wall_s:.0f} s{' (cached)' if cached else ''}")
    return result


def _warnings(log: Path) -> list[str]:
    seen: list[str] = []
    for line in log.read_text(errors="replace").splitlines():
        if "WARNING" in line and not any(n in line for n in NOISE):
            msg = line.split("WARNING", 1)[1].strip(" -:")
            if msg not in seen:
                seen.append(msg)
    return seen[:20]


def dense_path(checkpoint_dir: str | Path) -> Path:
    return Path(str(checkpoint_dir) + "-dense-" + keys.source_hash(keys.DEQUANTIZE_WORKER)[:12])


def dense_copy(qr: QuantizeResult, vdir: Path, spent) -> Path:
    """Dequantized weights of a checkpoint, for engines without the scheme's kernel (cached;
    usually written by the quantize worker itself, saving a process start)."""
    out = dense_path(qr.checkpoint_dir)
    if (out / "config.json").exists():
        return out
    with atomic_dir(out) as tmp:
        envs.run_quantize_env("pipeline.engines.workers.dequantize_worker", [qr.checkpoint_dir, str(tmp)],
                              vdir / "dequantize.log", 3600, "dequantization", spent, label=qr.variant)
    return out


def checkpoint_of(v, base: Path, base_hash: str) -> Path:
    """The folder an import variant names; `example:gptq` / `example:awq`: an RTN 4-bit checkpoint of
    the base model in that layout, written into the cache once (pipeline/store/legacy_formats.py)."""
    if not v.checkpoint.startswith(EXAMPLE):
        return Path(v.checkpoint).resolve()
    fmt = v.checkpoint[len(EXAMPLE):]
    writer = keys.source_hash(keys.PIPELINE / "store" / "legacy_formats.py")[:8]
    out = envs.home() / "imports" / f"{base_hash[:16]}-{fmt}-{writer}"
    if not (out / "config.json").exists():
        from pipeline.store import legacy_formats

        say(v.name, f"import: writing an example {fmt}-format checkpoint of the base model (RTN 4-bit, "
                    f"first use) to {out}")
        with atomic_dir(out, replace=False) as tmp:  # deterministic: a second writer's copy is the same
            legacy_formats.write(base, tmp, fmt)
    return out


def import_checkpoint(v, vdir: Path, base: Path, ckpt: Path) -> QuantizeResult:
    """An existing checkpoint as a variant: nothing is quantized, its facts are recorded."""
    key = hash_obj(provenance.model_hashes(ckpt))
    done = read_result(vdir / "quantize.json", QuantizeResult, key)
    if done and done.status == "ok":
        return done
    qc = json.loads((ckpt / "config.json").read_text()).get("quantization_config", {})
    size = weight_bytes(ckpt)
    result = QuantizeResult(
        variant=v.name, input_hash=key, status="ok", duration_s=0.0, scheme=f"import ({qc.get('quant_method')})",
        checkpoint_dir=str(ckpt), checkpoint_bytes=size, cache_key=key[:24], cached=True,
        llmcompressor_recipe=None, ignored_modules=list(qc.get("ignore") or qc.get("modules_to_not_convert") or []),
        facts=checkpoints.facts(ckpt, base, size), versions={"producer": str(qc.get("quant_method"))})
    write_json(vdir / "quantize.json", result)
    say(v.name, f"import: {ckpt} ({qc.get('quant_method')}, {size / 2**20:.0f} MiB, "
                f"{result.facts['bits_per_weight']} bits/weight in effect)")
    return result
