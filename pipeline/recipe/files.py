"""The files around a recipe: reading the recipe's YAML, and checking the files it points to.

A recipe is read with duplicate keys refused (a second `variants:` must not silently win);
the model directory, an imported checkpoint and a custom llm-compressor recipe it names are
checked before anything runs. Every problem is a RecipeError of one line naming the field
or file. pipeline/recipe/schema.py holds the schema and `load`, which calls these.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

IMPORT_FORMATS = ("gptq", "awq", "compressed-tensors")


class RecipeError(Exception):
    """A recipe that cannot run; the message is one line naming the field or file."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: a second `variants:` must not silently win."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, (str, int, float, bool)) and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        if isinstance(key, (str, int, float, bool)):
            seen.add(key)
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def one_line(text: str) -> str:
    return " ".join(str(text).split())[:300]


def read_mapping(p: Path) -> dict:
    """The recipe file's YAML mapping, duplicate keys refused."""
    if not p.is_file():
        raise RecipeError(f"{p}: recipe file not found")
    try:
        data = yaml.load(p.read_text(), Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"{p}:{where} malformed YAML: {one_line(problem)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{p}: cannot read recipe: {exc}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{p}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


EXAMPLE = "example:"  # checkpoint: example:gptq, written on first use (pipeline/stages/quantize.py)
EXAMPLE_FORMATS = ("gptq", "awq")


def check_import(checkpoint: str, recipe_path: Path, field: str) -> None:
    """An import variant's checkpoint: a folder that holds one, or one of the examples."""
    if not checkpoint.startswith(EXAMPLE):
        return check_checkpoint_dir(Path(checkpoint), recipe_path, field)
    if checkpoint[len(EXAMPLE):] not in EXAMPLE_FORMATS:
        raise RecipeError(f"{recipe_path}: {field}: {checkpoint!r}: examples are "
                          + ", ".join(EXAMPLE + f for f in EXAMPLE_FORMATS))


def check_checkpoint_dir(ckpt: Path, recipe_path: Path, field: str) -> None:
    if not (ckpt / "config.json").is_file():
        raise RecipeError(f"{recipe_path}: {field}: {ckpt} has no config.json (not a checkpoint directory; "
                          "`quantize-eval make-legacy` writes example GPTQ/AWQ-format ones)")
    try:
        qc = json.loads((ckpt / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError) as exc:
        raise RecipeError(f"{recipe_path}: {field}: {ckpt / 'config.json'} is not valid JSON: {exc}") from None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in IMPORT_FORMATS:
        raise RecipeError(f"{recipe_path}: {field}: {ckpt / 'config.json'} quantization_config.quant_method is "
                          f"{method!r}; importable formats: {', '.join(IMPORT_FORMATS)}")
    if not any(ckpt.glob("*.safetensors")):
        raise RecipeError(f"{recipe_path}: {field}: {ckpt} has no *.safetensors weights")


def check_llmc_recipe(path: Path, recipe_path: Path, field: str) -> None:
    if not path.is_file():
        raise RecipeError(f"{recipe_path}: {field}: {path} not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"{recipe_path}: {field}: {path} is not valid YAML: {one_line(exc)}") from None
    if not isinstance(data, dict) or not data:
        raise RecipeError(f"{recipe_path}: {field}: {path} is not an llm-compressor recipe (a YAML mapping "
                          "of stages to modifiers)")


def check_model_dir(model_dir: Path, recipe_path: Path) -> None:
    if not model_dir.is_dir():
        raise RecipeError(f"{recipe_path}: model.path: {model_dir} is not a directory")
    if not (model_dir / "config.json").is_file():
        raise RecipeError(f"{recipe_path}: model.path: {model_dir} has no config.json")
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise RecipeError(f"{recipe_path}: model.path: {model_dir / 'config.json'} is not valid JSON: "
                          f"{one_line(exc)}") from None
    if not isinstance(cfg, dict) or not cfg.get("architectures"):
        raise RecipeError(f"{recipe_path}: model.path: {model_dir / 'config.json'} names no architectures "
                          "(the engine picks its model class from it)")
    if not any(model_dir.glob("*.safetensors")) and not any(model_dir.glob("*.bin")):
        raise RecipeError(f"{recipe_path}: model.path: {model_dir} has no weights (*.safetensors or *.bin)")
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise RecipeError(f"{recipe_path}: model.path: {model_dir} has no tokenizer")
