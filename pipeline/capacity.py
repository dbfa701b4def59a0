"""KV-cache arithmetic: bytes per token from the model config and sequences a pool admits.

Pure functions of numbers and the model config; systems, admission and sign-off read them.
"""

from __future__ import annotations

import math

from pipeline import modelcfg


def kv_bytes_per_token(cfg: dict, bytes_per_elem: int) -> int:
    """Keys and values of one token over every layer: 2 * layers * kv_heads * head_dim * bytes."""
    layers = modelcfg.text_config(cfg)["num_hidden_layers"]
    return 2 * layers * modelcfg.kv_heads(cfg) * modelcfg.head_dim(cfg) * bytes_per_elem


def admitted(blocks: int, block: int, seq_len: int, max_num_seqs: int | None = None) -> int:
    """Sequences of seq_len tokens the KV pool holds at once (vLLM keeps one of its blocks as a
    null block), capped by max_num_seqs when given."""
    n = (blocks - 1) // math.ceil(seq_len / block)
    return min(n, max_num_seqs) if max_num_seqs else n
