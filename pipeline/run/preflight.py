"""Checks made before any work starts that need the resolved model or the machine.

The recipe schema (pipeline/recipe/schema.py) checks what the recipe alone can tell; these need the
model's config, the disk, the data packages or the runs folder. Each failure is one line
naming the field or file (exit 2), raised before an engine or a quantizer starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from pathlib import Path

from pipeline.engines import interface
from pipeline.recipe.schema import Recipe
from pipeline.runstore import weight_bytes
from pipeline.schemes import W4_SCHEMES
from pipeline.setup import assets, envs, host, modelcfg, models


class PreflightError(Exception):
    """The recipe is valid but cannot run here (model limits, disk); one line, exit 2."""


def _divisor(d: int) -> int:
    return next(g for g in (128, 64, 32, 16) if d % g == 0) if d % 16 == 0 else 1


def check_model_limits(recipe: Recipe, recipe_path: Path, model_dir: Path) -> None:
    """Context length within the model's, and every 4-bit group tiling every Linear's input."""
    try:
        cfg = modelcfg.read(model_dir)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    text_cfg = modelcfg.text_config(cfg)
    limit = text_cfg.get("max_position_embeddings")
    if limit and recipe.engine.max_model_len > limit:
        raise PreflightError(f"{recipe_path}: engine.max_model_len {recipe.engine.max_model_len} exceeds the "
                             f"model's max_position_embeddings {limit} ({model_dir / 'config.json'})")
    dims = {k: text_cfg.get(k) for k in ("hidden_size", "intermediate_size")}
    if text_cfg.get("num_attention_heads") and text_cfg.get("head_dim"):
        dims["num_attention_heads * head_dim"] = text_cfg["num_attention_heads"] * text_cfg["head_dim"]
    groups = [(f"variants.{i}.group_size", v.group_size) for i, v in enumerate(recipe.variants)
              if v.scheme in W4_SCHEMES]
    if recipe.search is not None:
        groups.append(("search.group_size", recipe.search.group_size))
    for field, g in groups:  # a group must tile every Linear's input features
        bad = {k: d for k, d in dims.items() if d and g and d % g}
        if bad:
            k, d = next(iter(bad.items()))
            raise PreflightError(f"{recipe_path}: {field}: {g} does not divide the model's {k} = {d}; pick a "
                                 f"divisor (e.g. {_divisor(d)}) or null for per-channel")


def check_search(recipe: Recipe, recipe_path: Path, model_dir: Path) -> None:
    """The sensitivity windows fit the model's context and the drift corpus before the suite's own windows."""
    if recipe.search is None:
        return
    from pipeline.stages import sensitivity

    s = recipe.search.sensitivity
    limit = modelcfg.text_config(modelcfg.read(model_dir)).get("max_position_embeddings")
    if limit and s.window_tokens > limit:
        raise PreflightError(f"{recipe_path}: search.sensitivity.window_tokens: {s.window_tokens} exceeds the model's "
                             f"max_position_embeddings {limit}")
    try:
        sensitivity.windows(recipe, model_dir)
    except ValueError as exc:
        raise PreflightError(f"{recipe_path}: {exc}") from None


def check_drift(recipe: Recipe, recipe_path: Path, model_dir: Path) -> None:
    """The drift windows fit their corpora and span enough essays: the intervals resample whole essays, so
    one essay bounds nothing, and a search cuts them into two halves of two essays or more."""
    if "drift" not in recipe.quality.suites:
        return
    from transformers import AutoTokenizer

    from pipeline.stages import quality

    d = recipe.quality.drift
    try:
        windows = quality.drift_windows(AutoTokenizer.from_pretrained(model_dir), d)
    except ValueError as exc:
        raise PreflightError(f"{recipe_path}: {exc}") from None
    docs = {w["doc"] for w in windows if w["domain"] == "essays"}
    need = 4 if recipe.search is not None else 2
    if len(docs) < need:
        why = ("a search signs its answer off on essays it never read, so each half needs two"
               if recipe.search is not None else "its intervals resample whole essays, and one bounds nothing")
        raise PreflightError(f"{recipe_path}: quality.drift.windows: {d.windows} x {d.window_tokens} tokens span "
                             f"{len(docs)} essay(s), {need} needed ({why}): raise quality.drift.windows")


def _base_plan(recipe: Recipe, model_dir: Path):
    """The base model's predicted pool under the recipe's budget, from this host's engine-overhead figures
    (or the prior when it has none yet); None when not in budget mode, the engine sizes no pool, or the config
    lacks the attention shapes."""
    from pipeline.measure import membudget, overhead
    from pipeline.store import provenance

    if membudget.mode(recipe.engine, envs.has_nvidia_gpu()) != "budget":
        return None
    if interface.kind(recipe.engine.kind).systems_not_measured():
        return None
    dtype = host.resolve_dtype(recipe.engine.dtype)
    act = provenance.dtype_bytes(dtype)
    cfg = modelcfg.read(model_dir)
    w = recipe.workload
    try:
        figures = overhead.host_figures(dtype, overhead.model_label(recipe))
        budget, source = membudget.run_budget(recipe.engine, cfg, model_dir, act, act, figures)
        p = membudget.plan(recipe.engine, cfg, model_dir, act, act, False,
                           {**figures, "budget_bytes": budget, "budget_source": source},
                           seq_len=w.prompt_tokens + w.output_tokens)
    except KeyError:  # a config without the attention shapes: the engine's start will say what is wrong
        return None
    return p, cfg, act


def check_budget(recipe: Recipe, recipe_path: Path, model_dir: Path) -> None:
    """A memory budget that cannot hold the base model's weights as loaded, the engine's runtime and what its
    sizing does not count (this host's measurements, else the prior) and one max_model_len sequence."""
    from pipeline.measure import membudget

    try:
        planned = _base_plan(recipe, model_dir)
        if planned is None:
            return
        p, cfg, act = planned
        membudget.check_fits(p, cfg, recipe.engine, act, "the base model")
    except ValueError as exc:
        raise PreflightError(f"{recipe_path}: {exc}") from None


def budget_statement(recipe: Recipe, model_dir: Path) -> str | None:
    """What the budget is predicted to leave the base model, in one line, and how sure that is (validate)."""
    try:
        planned = _base_plan(recipe, model_dir)
    except ValueError:
        return None
    if planned is None:
        return None
    p = planned[0]
    w = recipe.workload
    return (f"budget {p.budget_bytes / 2**30:g} GiB ({p.budget_source}): base weights "
            f"{p.weights_bytes / 2**30:.2f} GiB as loaded + "
            f"engine runtime {p.runtime_bytes / 2**30:.2f} GiB + {p.outside_bytes / 2**30:.2f} GiB outside its sizing "
            f"leave a predicted {p.pool_bytes / 2**30:.2f} GiB KV pool: {p.tokens:,} tokens, {p.admitted} requests of "
            f"{w.prompt_tokens}+{w.output_tokens} tokens (runtime figures {p.overhead_source}; each engine sizes its "
            f"own pool, within ±{p.tolerance_bytes / 2**20:.0f} MiB of the budget)")


def check_disk(recipe: Recipe, model_dir: Path) -> None:
    weights = weight_bytes(model_dir)
    # each checkpoint is smaller than the model; where an engine lacks a scheme's kernel (CPU) its float32 dense
    # copy (dequantize_worker) is up to twice a 16-bit model
    need = weights * (1 + len(recipe.variants) * (1 if envs.has_nvidia_gpu() else 3))
    home = envs.home()
    home.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(home).free
    if free < need:
        raise PreflightError(f"{home}: {free / 2**30:.1f} GiB free, checkpoints for "
                             f"{len(recipe.variants)} variant(s) need about {need / 2**30:.1f} GiB")


def fetch_data(recipe: Recipe, recipe_path: Path) -> None:
    """The data every variant needs, fetched (once) before any work."""
    try:
        for suite in recipe.quality.suites:
            assets.fetch_suite(suite)
        assets.calibration_text(recipe.calibration.dataset)
    except (assets.AssetError, OSError, KeyError, ValueError) as exc:
        raise PreflightError(f"{recipe_path}: quality/calibration data unavailable: {exc}") from None


def check_runs_dir(recipe: Recipe, recipe_path: Path) -> None:
    runs = Path(recipe.runs_dir)
    probe = runs if runs.exists() else runs.parent
    if not os.access(probe if probe.exists() else Path("."), os.W_OK):
        raise PreflightError(f"{recipe_path}: runs_dir {runs} is not writable")


def _ray_auto_address() -> str | None:
    """Where `ray.init(address="auto")` would connect, found as Ray finds it but without importing Ray:
    RAY_ADDRESS, else the cluster `ray start` recorded in its temp folder, else a running GCS server."""
    if os.environ.get("RAY_ADDRESS") not in (None, "", "auto"):
        return os.environ["RAY_ADDRESS"]
    current = Path(os.environ.get("RAY_TMPDIR") or "/tmp") / "ray" / "ray_current_cluster"
    with contextlib.suppress(OSError):
        if addr := current.read_text().strip():
            return addr
    import psutil

    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "gcs_server":
            args = dict(a.lstrip("-").split("=", 1) for a in proc.info["cmdline"] or [] if "=" in a)
            if "gcs_server_port" in args:
                return f"{args.get('node-ip-address') or args.get('node_ip_address') or '127.0.0.1'}:{args['gcs_server_port']}"
    return None


# the HTTP/2 client preface and an empty SETTINGS frame: a gRPC server (Ray's GCS and client server) answers
# with its own SETTINGS frame (length 3 bytes, type 0x4)
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _speaks_grpc(host: str, port: int, timeout: float = 10.0) -> bool:
    with socket.create_connection((host, port), timeout=timeout) as conn:
        conn.sendall(_H2_PREFACE)
        head = b""
        while len(head) < 9:
            chunk = conn.recv(9 - len(head))
            if not chunk:
                return False
            head += chunk
    return head[3] == 0x04


def check_ray_address(recipe: Recipe) -> None:
    """A cluster address that does not answer, or answers but is not Ray, fails now in one line, before the
    run folder is touched: Ray itself retries for minutes, then raises a traceback."""
    ex = recipe.executor
    if ex.kind != "ray" or ex.address is None:
        return
    address = ex.address
    if address == "auto":
        address = _ray_auto_address()
        if address is None:
            raise PreflightError("executor.address: auto found no Ray cluster on this machine (no RAY_ADDRESS, no "
                                 "cluster recorded by `ray start`, no GCS server running); start one with "
                                 "`ray start --head`, or run with --ray local")
    hostport = address.removeprefix("ray://").rsplit("/", 1)[0]
    where, _, port = hostport.rpartition(":")
    if not where or not port.isdigit():
        raise PreflightError(f"executor.address: {ex.address!r} is not host:port (or ray://host:port, auto)")
    try:
        grpc = _speaks_grpc(where.strip("[]"), int(port))
    except OSError as exc:
        raise PreflightError(f"executor.address: the Ray cluster at {address} does not answer "
                             f"({exc.strerror or exc}); is `ray start --head` running there?") from None
    if not grpc:
        raise PreflightError(f"executor.address: {address} answers, but not as a Ray cluster does (no gRPC); "
                             "is it the port `ray start --head` printed?")


def _extracted(suite: str, limit: int | None) -> list[dict] | None:
    """The first `limit` items of a builtin suite, if its data was extracted already (validate fetches nothing)."""
    if suite not in assets.DATA_SOURCES or not (path := assets.suite_data_path(suite)).exists():
        return None
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return rows[:limit] if limit else rows


def items_in_scope(recipe: Recipe, scope: str) -> int | None:
    """Items a quality gate is judged on, as far as the recipe and the data already extracted fix them
    (None: known after the run)."""
    q = recipe.quality
    if "/" in scope:  # a slice of a builtin suite whose items are at hand, by a slice its data carries
        suite, _, cut = scope.partition("/")
        dim, _, value = cut.partition("=")
        rows = _extracted(suite, q.limit_of(suite))
        if rows is None or dim == "prompt_len":  # prompt length: known once the items are tokenized
            return None
        return sum((r.get("slices") or {}).get(dim) == value for r in rows)

    def items(suite: str) -> int | None:
        if suite == "drift":
            return 0
        limit = q.limit_of(suite)
        if suite == "needle":
            cells = len(q.needle.context_tokens) * len(q.needle.depths) * q.needle.per_cell
            return min(cells, limit) if limit else cells
        rows = _extracted(suite, limit)
        return len(rows) if rows is not None else limit

    counts = [items(s) for s in (q.suites if scope in ("overall", "each_suite") else [scope])]
    if None in counts:
        return None
    return sum(counts) if scope == "overall" else (min(counts) if scope == "each_suite" else counts[0])


def power_statements(recipe: Recipe) -> list[str]:
    """Per non-inferiority quality gate, what it can certify at these item counts (pipeline/measure/power.py)."""
    from pipeline.measure import power

    out = []
    for i, g in enumerate(recipe.gates):
        if g.metric not in ("accuracy_delta", "refusal_rate_delta") or g.op != ">=" or g.threshold >= 0:
            continue
        scope = "harmbench" if g.metric == "refusal_rate_delta" and g.scope == "overall" else g.scope
        n = items_in_scope(recipe, scope)
        where = f"gates.{i} {g.metric}[{g.scope}] >= {g.threshold:g}"
        if n and recipe.search is not None:  # the ladder reads half the items, the answer is signed on the other
            n //= 2
            where += " (a search judges each half of the items apart)"
        out.append(f"{where}: " + (power.noninferiority(n, -g.threshold).describe() if n else
                                    "item count known after the run (a slice, or a suite without a limit)"))
    return out


def for_validate(recipe: Recipe, recipe_path: Path) -> str | None:
    """The checks `run` makes before any work, as far as they need nothing fetched or converted:
    `validate` applies them. Returns what it could not check yet, or None."""
    if recipe.model.builtin:
        model_dir = models.model_dir(recipe.model.builtin)
        if not (model_dir / "qe-model.json").exists():
            check_runs_dir(recipe, recipe_path)
            return "model limits: checked once the builtin model is converted (on the first run)"
    else:
        model_dir = Path(recipe.model.path).resolve()
    check_model_limits(recipe, recipe_path, model_dir)
    check_search(recipe, recipe_path, model_dir)
    check_drift(recipe, recipe_path, model_dir)
    check_disk(recipe, model_dir)
    check_budget(recipe, recipe_path, model_dir)
    check_runs_dir(recipe, recipe_path)
    if not recipe.model.builtin:
        check_architecture(recipe, model_dir)
    return None


def check_architecture(recipe: Recipe, model_dir: Path) -> None:
    """The engine's own registry knows the model class the config names (validate only: importing the
    engine costs seconds, and a run's engine start says the same a minute later)."""
    known = interface.kind(recipe.engine.kind).architectures()
    if known is None:  # validate run outside the engine environment: nothing to ask
        return
    archs = modelcfg.read(model_dir).get("architectures") or []
    if not any(a in known for a in archs):
        raise PreflightError(f"{model_dir / 'config.json'}: architectures {archs}: no model class of this engine "
                             "serves it")


def preflight(recipe: Recipe, recipe_path: Path, model_dir: Path) -> None:
    check_model_limits(recipe, recipe_path, model_dir)
    check_search(recipe, recipe_path, model_dir)
    check_drift(recipe, recipe_path, model_dir)
    check_disk(recipe, model_dir)
    check_budget(recipe, recipe_path, model_dir)
    fetch_data(recipe, recipe_path)
    check_runs_dir(recipe, recipe_path)
