"""KV-cache arithmetic as vLLM (0.32, v1 KV cache manager) does it: pool bytes -> blocks -> requests.

Pure functions of numbers and the model config; the budget plan, systems, admission and sign-off
read them. How vLLM lays a pool out (vllm/v1/core/kv_cache_utils.py):

- Every attention layer has a page of `block_size` tokens: 2 (K and V) * block * kv_heads per
  tensor-parallel rank * head_dim * bytes per element.
- Layers are bucketed by attention type (full; sliding window of one size). All buckets are cut
  into groups of one size: the smallest bucket's layer count (the largest's when it is under
  1.5x the smallest), the last group of a bucket padded. One block of the pool is one page of
  every layer of one group: `bytes_per_block = group_size * page`, so
  `num_blocks = pool // bytes_per_block` and the engine reports `num_blocks * block_size` tokens.
- All groups draw their block ids from that one pool. A request of L tokens takes cdiv(L, block)
  blocks in each full-attention group and, in each sliding-window group,
  cdiv(min(window - 1 + in_flight_tokens, L), block) + 1 (the window need not start on a block
  boundary; in-flight tokens are the scheduled but not yet freed ones, one batch per concurrent
  step). One block of the pool is vLLM's null block.
A dense model is one group of all its layers, so its pool holds pool // (layers * page) blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.setup import modelcfg


def kv_bytes_per_token(cfg: dict, bytes_per_elem: int, tp: int = 1) -> int:
    """Keys and values of one token over every layer on one tensor-parallel rank:
    2 * layers * kv_heads_per_rank * head_dim * bytes."""
    layers = modelcfg.text_config(cfg)["num_hidden_layers"]
    return 2 * layers * kv_heads_per_rank(cfg, tp) * modelcfg.head_dim(cfg) * bytes_per_elem


def kv_heads_per_rank(cfg: dict, tp: int) -> int:
    """KV heads one rank holds: split across ranks, replicated when there are fewer heads than ranks."""
    return max(1, modelcfg.kv_heads(cfg) // tp)


def layer_types(c: dict) -> list[str] | None:
    """The text config's `layer_types`, or what its transformers config class derives when the file
    leaves them out (Gemma 2/3 configs written before the field existed: a sliding pattern, not every
    layer sliding), as vLLM sees them through that class; None where neither says."""
    if c.get("layer_types"):
        return c["layer_types"]
    try:
        import warnings

        from transformers import CONFIG_MAPPING
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            derived = CONFIG_MAPPING[c["model_type"]](**{k: v for k, v in c.items() if k != "model_type"})
    except Exception:  # noqa: BLE001 - no transformers here, an unknown model type, a config it refuses
        return None
    return list(getattr(derived, "layer_types", None) or []) or None


def layer_windows(cfg: dict) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention). `layer_types` where the config
    lists them or its transformers class derives them (Gemma 2/3, Qwen 2.x, gpt-oss), else every layer
    sliding when the config sets a window it uses (Mistral), else every layer full."""
    c = modelcfg.text_config(cfg)
    n = c["num_hidden_layers"]
    window = c.get("sliding_window")
    types = layer_types(c)
    if types:
        return [window if t == "sliding_attention" and window else None for t in types[:n]]
    if window and c.get("use_sliding_window", True):
        return [window] * n
    return [None] * n


@dataclass(frozen=True)
class Layout:
    """How one engine's KV pool is cut: bytes of one block, the groups that share each block id."""

    block: int  # tokens per block
    page_bytes: int  # one layer's page of `block` tokens
    group_size: int  # layers per group: one block of the pool is one page of each
    groups: tuple[int | None, ...]  # each group's sliding window (None: full attention)

    @property
    def bytes_per_block(self) -> int:
        return self.group_size * self.page_bytes

    def num_blocks(self, pool_bytes: int) -> int:
        return max(0, pool_bytes) // self.bytes_per_block

    def tokens(self, pool_bytes: int) -> int:
        """What the engine reports as its KV capacity: blocks * block size."""
        return self.num_blocks(pool_bytes) * self.block

    def blocks_per_request(self, seq_len: int, in_flight_tokens: int = 0) -> int:
        """Blocks one request of seq_len tokens holds across every group, at most."""
        total = 0
        for window in self.groups:
            if window is None:
                total += math.ceil(seq_len / self.block)
            else:
                total += math.ceil(min(window - 1 + in_flight_tokens, seq_len) / self.block) + 1
        return total

    def admitted(self, pool_bytes: int, seq_len: int, max_num_seqs: int | None = None,
                 in_flight_tokens: int = 0) -> int:
        """Requests of seq_len tokens the pool holds at once (one block is the null block),
        capped by max_num_seqs when given."""
        return admitted_blocks(self.num_blocks(pool_bytes), self.blocks_per_request(seq_len, in_flight_tokens),
                               max_num_seqs)

    def pool_for(self, seq_len: int, sequences: int = 1, in_flight_tokens: int = 0) -> int:
        """The smallest pool that holds `sequences` requests of seq_len tokens (plus the null block)."""
        return (sequences * self.blocks_per_request(seq_len, in_flight_tokens) + 1) * self.bytes_per_block


def layout(cfg: dict, bytes_per_elem: int, block: int = 16, tp: int = 1) -> Layout:
    """The KV layout vLLM builds for this model (see the module docstring)."""
    page = 2 * block * kv_heads_per_rank(cfg, tp) * modelcfg.head_dim(cfg) * bytes_per_elem
    buckets: dict[int | None, int] = {}
    for w in layer_windows(cfg):
        buckets[w] = buckets.get(w, 0) + 1
    smallest, largest = min(buckets.values()), max(buckets.values())
    size = largest if largest < smallest * 1.5 else smallest
    groups: list[int | None] = []
    for w, n in buckets.items():
        groups += [w] * math.ceil(n / size)
    return Layout(block=block, page_bytes=page, group_size=size, groups=tuple(groups))


def admitted_blocks(blocks: int, per_request: int, max_num_seqs: int | None = None) -> int:
    n = max(0, blocks - 1) // per_request
    return min(n, max_num_seqs) if max_num_seqs else n


def admitted(blocks: int, block: int, seq_len: int, max_num_seqs: int | None = None) -> int:
    """Sequences of seq_len tokens a full-attention pool of `blocks` blocks holds at once (vLLM keeps
    one of its blocks as a null block), capped by max_num_seqs when given."""
    return admitted_blocks(blocks, math.ceil(seq_len / block), max_num_seqs)
