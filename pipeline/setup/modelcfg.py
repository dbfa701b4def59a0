"""A model's config.json, read once the same way everywhere: the text part and its shapes.

Multimodal configs nest the language model under `text_config`; older configs leave
`head_dim` out (hidden_size / num_attention_heads). Every reader of layer counts, heads or
head size goes through here.
"""

from __future__ import annotations

import json
from pathlib import Path


def read(model_dir: Path) -> dict:
    """The parsed config.json of a model or checkpoint folder; ValueError names the file."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    return cfg


def text_config(cfg: dict) -> dict:
    """The language model's part of a config (the whole config for text-only models)."""
    return cfg.get("text_config", cfg)


def head_dim(cfg: dict) -> int:
    c = text_config(cfg)
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def kv_heads(cfg: dict) -> int:
    c = text_config(cfg)
    return c.get("num_key_value_heads", c["num_attention_heads"])
