"""What an engine holds that its own pool sizing does not count: the budget keeps room for it.

Each engine sizes its own KV pool under the budget (pipeline/engines/vllm/sizing.py): its worker asks for
a fraction of the node's memory and the pool is that request minus what the worker then holds, so each
variant's weights and runtime are counted by its own engine. Two figures the engine cannot know are kept
here, per host, engine environment and dtype:

    outside   what the engine's process tree holds at its peak beyond the worker's request: the API
              server, helper processes, the worker's transient above the memory it sized from. The
              budget keeps it aside: fraction = (budget - outside) / node memory.
    runtime   the worker's memory besides its weights and its pool (interpreter, vLLM, warm-up
              activations). Used only to predict: whether a budget holds the model (validate) and the
              capacity of a variant no engine runs natively here (projected, and labelled so).

Both move with the model, not only the host: a large vocabulary's tokenizer and embeddings (gemma3-270m's 262k
tokens) make both several times the default model's (docs/performance.md). So the figures are kept per host
*and base model* (its builtin name or path): one model's run never resizes another's. Every budget-sized
engine that serves the systems load measures both (its peak from the memory sampler, the rest read back from
its log). A run fixes the figures it uses when it first needs them (the run folder's engine-overhead.json), so
every variant of a run is sized alike. `outside` starts at PRIOR and only rises, and only by more than the
budget's tolerance (a serving load heavier than any before): `outside` keys every budget-sized result, so a
rerun, or another recipe on the same model, keys the same results, and a heavier recipe's peak is kept from
then on. Each engine's own peak, checked against the budget, says whether the figure held.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import time
from pathlib import Path

from pipeline.runstore import hash_obj, write_json
from pipeline.setup import envs, host

GIB = 2**30
VERSION = 1
# vLLM 0.32 on CPU: the API server process holds ~0.95 GiB once it has imported vLLM and loaded the
# tokenizer, and an eager worker grows by a few hundred MiB past the memory it sized from once it serves a
# full batch (it sizes before any forward pass when graphs are not compiled); the worker holds ~0.85-1.1
# GiB besides weights and pool. Rounded up, as a first engine on a host has nothing better to go on (its
# peak check then says whether it held)
PRIOR = {"outside_bytes": int(1.25 * GIB), "runtime_bytes": int(0.9 * GIB),
         "source": "not measured on this host yet: the figures vLLM 0.32 held on the CPU kinds measured"}


def host_key(dtype: str, model: str | None = None) -> str:
    """This host's engine of this base model as far as its overhead goes: the model, the engine environment,
    the dtype, the CPU (or GPU) kind, cores and machine; not the memory size, which moves on some machines
    while they run."""
    gpu = envs.has_nvidia_gpu()
    return hash_obj({"version": VERSION, "dtype": dtype, "engine_env": envs.requirements_file("engine").read_text(),
                     "kind": "cuda" if gpu else host.cpu_kind(), "cpus": os.cpu_count(), "node": platform.node(),
                     **({"model": model} if model else {})})


def _host_file(dtype: str, model: str | None = None) -> Path:
    return envs.home() / "results" / "engine-overhead" / f"{host_key(dtype, model)}.json"


def _read(path: Path, key: str, field: str = "key") -> dict | None:
    """The figures in `path` if its `field` is `key` (a host's key, a run's dtype), else None."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if d.get(field) == key else None


def model_label(recipe) -> str:
    """The base model as the host's per-model figures name it: a builtin's name, else its resolved path."""
    return recipe.model.builtin or str(Path(recipe.model.path).resolve())


def host_figures(dtype: str, model: str | None = None) -> dict:
    """The figures measured on this host for this base model, else PRIOR (each with its source)."""
    key = host_key(dtype, model)
    return _read(_host_file(dtype, model), key) or {"key": key, **PRIOR}


_FIRST = {"outside_source": "the prior, which no engine on this host has exceeded",
          "runtime_source": "the prior, within the tolerance of what this host's engines held"}


def record_refusal(dtype: str, model: str, runtime_bytes: int) -> None:
    """An engine of `model` refused to start because, loaded, it held more than its budget left it: keep its
    runtime (held besides weights and pool) for this model on this host, so validate and the next run's plan
    predict it before any engine starts."""
    old = _stored(dtype, model)
    when = f"measured on this host by an engine of {model} that refused its budget ({time.strftime('%Y-%m-%d %H:%M')})"
    _store(dtype, model, {**(old or {**PRIOR, **_FIRST}), "runtime_bytes": int(runtime_bytes), "runtime_source": when})


def _stored(dtype: str, model: str | None) -> dict | None:
    return _read(_host_file(dtype, model), host_key(dtype, model))


def _store(dtype: str, model: str | None, d: dict) -> None:
    """Write a model's figures on this host, their source said from each figure's own."""
    d = {**d, "source": f"outside: {d['outside_source']}; runtime: {d['runtime_source']}", "key": host_key(dtype, model)}
    path = _host_file(dtype, model)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, d)


def for_run(run_root: Path, dtype: str, log=print, model: str | None = None) -> dict:
    """The figures every engine of this run is sized with: fixed by the first engine that needs them."""
    here = run_root / "engine-overhead.json"
    if (d := _read(here, dtype, "dtype")) is not None:
        return d
    run_root.mkdir(parents=True, exist_ok=True)
    with open(run_root / "engine-overhead.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # every Ray node shares the run folder, and these figures
        if (d := _read(here, dtype, "dtype")) is not None:
            return d
        d = {**host_figures(dtype, model), "dtype": dtype}
        log(f"memory budget: {d['outside_bytes'] / GIB:.2f} GiB kept for what the engine's own sizing does not "
            f"count ({d['source']})")
        write_json(here, d)
        return d


def measured(sizing: dict, peak_bytes: int | None, weights_bytes: int | None) -> dict | None:
    """outside and runtime as one engine measured them; None where it could not say."""
    if not sizing or peak_bytes is None or "requested_bytes" not in sizing:
        return None
    out = {"outside_bytes": peak_bytes - sizing["requested_bytes"]}
    if weights_bytes is not None:
        out["runtime_bytes"] = sizing["non_kv_bytes"] - weights_bytes
    return out


def record(dtype: str, figures: dict | None, tolerance_bytes: int, who: str, model: str | None = None) -> None:
    """Keep what an engine measured as the host's figures. `outside` only rises, and only by more than the
    tolerance (a heavier serving load than any before, whose peak the budget must keep too), from PRIOR on
    a host with none: a first engine that held less leaves PRIOR be, so the figure a fresh host's first
    run was sized with, and so every result key, stays for the next run. `runtime` follows a change beyond
    the tolerance. Each figure's source says which engine set it."""
    if not figures or "runtime_bytes" not in figures:
        return
    old = _stored(dtype, model)
    base = old or {**PRIOR, **_FIRST}
    when = f"measured on this host by an engine of {who} ({time.strftime('%Y-%m-%d %H:%M')})"
    new = dict(base)
    if figures["outside_bytes"] > base["outside_bytes"] + tolerance_bytes:
        new.update(outside_bytes=figures["outside_bytes"], outside_source=when)
    if abs(figures["runtime_bytes"] - base["runtime_bytes"]) > tolerance_bytes:
        new.update(runtime_bytes=figures["runtime_bytes"], runtime_source=when)
    if old is not None and new == old:
        return
    _store(dtype, model, new)
