"""Store: what keys a result, what it was measured on, and what a run spent.

The result-cache keys (`keys`) and the cache itself (`resultcache`), what a result depends on
(`provenance`: hardware and CPU kind, versions, hashes), a variant's outcome and the run's accounting
(`outcome`), facts about checkpoints (`checkpoints`) and the GPTQ/AWQ-format writer (`legacy_formats`).
The run folder and its atomic files are one floor down, in `pipeline/runstore.py`; the typed result
of every stage in `pipeline/results.py`.
"""
