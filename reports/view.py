"""The typed view of a run that the page's sections read.

`collect()` gathers the run's files as plain dicts, and those are written unchanged as results.json
(compare, the tests and users read that shape). The sections instead read the stage files validated
into the models of pipeline/results.py, so a field is named once, in the model, and a misspelt one
fails loudly. A file of an older (or newer) shape does not stop the page: the nested parts that fail
to validate are dropped back to their defaults (an admission probe from before the ramp, say) and the
rest is shown; a file that still does not validate is treated as absent. support.json, error.json,
*.origin.json and manifest.json have no models and stay dicts.
"""

from __future__ import annotations

import copy
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ValidationError

from pipeline.results import AgreementResult, KVCapacity, PairedSlice, QualityResult, QuantizeResult, Signoff, SystemsResult

M = typing.TypeVar("M", bound=BaseModel)

# A KV section with nothing measured: what a systems result without one reads as.
NO_KV = KVCapacity(block_size=None, num_blocks=None, tokens=None, max_concurrency=None, bytes_per_token_config=None)


@dataclass(frozen=True)
class Variant:
    name: str
    quantize: QuantizeResult | None = None
    quality: QualityResult | None = None
    systems: SystemsResult | None = None
    error: dict | None = None
    support: dict | None = None
    agreement: AgreementResult | None = None  # the engine-agreement check (pipeline/stages/agreement.py)
    origins: dict[str, dict] = field(default_factory=dict)  # stage -> where a reused result was measured

    @property
    def measured(self) -> SystemsResult | None:
        """The systems result, unless the stage was skipped (then only the checkpoint size is known)."""
        return self.systems if self.systems and self.systems.status != "skipped" else None


@dataclass(frozen=True)
class Run:
    manifest: dict
    signoff: Signoff | None
    variants: dict[str, Variant]
    run_dir: Path | None = None
    search: dict | None = None  # RUN/search/search.json of `quantize-eval search`

    def paired(self, variant: str) -> dict[str, PairedSlice]:
        """The variant's paired comparisons with the baseline, by slice ('overall' among them)."""
        for v in self.signoff.variants if self.signoff else []:
            if v.variant == variant:
                return {p.slice: p for p in v.paired}
        return {}


def read_run(data: dict, run_dir: Path | None = None) -> Run:
    """The typed view of what collect() gathered."""
    variants = {}
    for name, r in data["variants"].items():
        variants[name] = Variant(
            name, quantize=validated(QuantizeResult, r.get("quantize")),
            quality=validated(QualityResult, r.get("quality")), systems=validated(SystemsResult, r.get("systems")),
            error=r.get("error"), support=r.get("support"), agreement=validated(AgreementResult, r.get("agreement")),
            origins={stage: r[f"{stage}.origin"] for stage in ("quality", "systems") if r.get(f"{stage}.origin")})
    return Run(data["manifest"], validated(Signoff, data.get("signoff")), variants, run_dir, data.get("search"))


def validated(model: type[M], raw) -> M | None:
    """raw validated into model; parts that do not validate are dropped (see the module docstring)."""
    if not isinstance(raw, dict):
        return None
    data = copy.deepcopy(raw)
    for _ in range(10):
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            drop = set()
            for err in exc.errors():
                loc = err["loc"]
                part = loc if err["type"] == "extra_forbidden" else _optional_part(model, loc)
                if part is None:
                    return None
                drop.add(part)
            for part in sorted(drop, key=len):
                _remove(data, part)
    return None


def _optional_part(model: type[BaseModel], loc: tuple) -> tuple | None:
    """The deepest nested record on the error's path that may be left out (it has a default)."""
    part, cls, i = None, model, 0
    while cls is not None and i < len(loc) and loc[i] in cls.model_fields:
        f = cls.model_fields[loc[i]]
        inner, keyed = _record_type(f.annotation)
        if inner is None:
            break
        if not f.is_required():
            part = loc[:i + 1]
        i += 2 if keyed else 1  # a list index or dict key follows a collection of records
        cls = inner
    return part


def _record_type(annotation) -> tuple[type[BaseModel] | None, bool]:
    """(the model a field holds, whether it holds a list or dict of them); (None, False) for plain values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for a in args:
            inner, keyed = _record_type(a)
            if inner is not None:
                return inner, keyed
    elif origin in (list, dict) and args:
        inner, _ = _record_type(args[-1])
        return (inner, True) if inner is not None else (None, False)
    return None, False


def _remove(data, path: tuple) -> None:
    for key in path[:-1]:
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(data, dict):
        data.pop(path[-1], None)
