"""Setup: what a run needs on this machine before it can start, built on first use and pinned.

The two Python environments (engine and quantize: `envs`, built by `installer` with uv or pip from the
configured package index; `pkgindex` fetches plain files from it), the builtin model and data assets
(`assets`), and the model config reader every layer shares (`modelcfg`). Standard library only where
it runs as a script: `python3 pipeline/setup/envs.py engine` prints the engine environment's Python.
"""
