"""The engines: what serves a variant, and what builds its weights.

interface.py   the seam every stage talks to: Launch (what one engine start depends on), Engine (a running
               engine: readiness, loaded weights, KV layout, scheduler gauges under neutral names),
               EngineKind (launch, which formats it serves and how it computes them), kind(name)
vllm/          vLLM behind that interface: the only code that knows its command line, metrics and kernels
transformers/  the reference engine (transformers + compressed-tensors) the engine-agreement check scores
               against: stages/agreement.py
formats.py     the formats a variant's weights take, read from a scheme or a checkpoint; an engine's decision
memory.py      memory of an engine's process tree (host RSS and high-water mark, device memory)
engine_guard.py  takes an engine's whole process group down if the pipeline dies
workers/       run in the quantize environment as subprocesses: llm-compressor, dequantization, sensitivity,
               the GGUF conversion of the default model

A second engine is a folder beside vllm/ whose __init__ defines the EngineKind functions; recipes name
it in engine.kind.
"""
