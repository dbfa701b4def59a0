"""Memory of an engine's process tree while it runs: host RSS and, on GPUs, device memory.

Host memory two ways: RSS summed over the tree, sampled every 0.25 s (what was resident at once),
and the kernel's own high-water mark of each process (VmHWM in /proc/PID/status), summed over the
processes of the tree alive at each sample: a sampled peak can miss a spike shorter than the interval
(a long prompt's logits), the high-water mark cannot. The memory budget's reserve is taken from the high-water mark.
"""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass, field

import psutil

from pipeline.setup import envs


def vm_hwm(pid: int) -> int | None:
    """The kernel's peak resident set of one process (VmHWM), bytes; None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _smi(*query: str) -> list[list[str]] | None:
    """Rows of an nvidia-smi CSV query, or None if nvidia-smi could not answer."""
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [[x.strip() for x in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def device_used_bytes() -> int | None:
    """Memory in use on the GPUs this process may use (CUDA_VISIBLE_DEVICES by index or UUID)."""
    rows = _smi("--query-gpu=index,uuid,memory.used")
    if rows is None:
        return None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    total = 0
    for row in rows:
        if len(row) == 3 and row[2].isdigit() and (not visible or row[0] in visible or row[1] in visible):
            total += int(row[2]) * 2**20
    return total


PER_PROCESS = "per process: nvidia-smi compute apps of the engine's process tree"
WHOLE_DEVICE = ("whole GPU in use minus before the engine started (the engine's PIDs are not visible to "
                "nvidia-smi, e.g. in a container): approximate, other processes on the GPU count too")


@dataclass
class MemorySampler:
    """Peak RSS summed over the engine's process tree, sampled every `interval` s; on GPU also the
    peak device memory of that tree, once a second."""

    root_pid: int
    interval: float = 0.25
    peak_tree_rss: int = 0
    peak_device: int = 0  # GPU: device memory of the tree's processes (nvidia-smi), else 0
    device_source: str | None = None  # how peak_device was attributed: PER_PROCESS or WHOLE_DEVICE
    device_before: int | None = None  # GPU memory in use before the engine started (WHOLE_DEVICE)
    peak_tree_hwm: int = 0  # sum over the tree of each process's kernel high-water mark (VmHWM)
    load_hwm: int | None = None  # the high-water mark once the engine was ready (mark_loaded)
    serving_hwm: int | None = None  # the high-water mark since begin_serving reset it
    _stop: threading.Event = field(default_factory=threading.Event)
    _gpu: bool = field(default_factory=lambda: envs.has_nvidia_gpu())
    _ticks: int = 0

    def _device_bytes(self, pids: set[int]) -> tuple[int, str | None]:
        """Device memory of these processes (MiB resolution) and how it was attributed. When
        nvidia-smi lists none of these PIDs with a figure (a container's PID namespace can list
        other PIDs or none; MIG and some containers say "[N/A]"), the whole device's use above
        what it was before the engine started."""
        apps = _smi("--query-compute-apps=pid,used_memory")
        if apps is None:
            return 0, None
        mine = [int(r[1]) * 2**20 for r in apps
                if len(r) == 2 and r[0].isdigit() and int(r[0]) in pids and r[1].isdigit()]
        if mine:
            return sum(mine), PER_PROCESS
        if self.device_before is not None:  # PIDs not ours or not listed at all, or memory "[N/A]"
            used = device_used_bytes()
            if used is not None:
                return max(0, used - self.device_before), WHOLE_DEVICE
        return 0, None

    def _sample(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        total, alive = 0, {}
        for p in procs[1:]:  # the root is the guard; the engine is everything below it
            try:
                total += p.memory_info().rss
            except (psutil.NoSuchProcess, OSError):
                continue
            hwm = vm_hwm(p.pid)
            if hwm is not None:
                alive[p.pid] = hwm
        # only processes alive at this sample are summed: a helper that came and went (vLLM inspects a
        # model's class in a subprocess that imports torch, then exits) was never resident beside the
        # engine's later peak, and summing every high-water mark ever seen counted it anyway
        now = sum(alive.values())
        self.peak_tree_rss = max(self.peak_tree_rss, total)
        self.peak_tree_hwm = max(self.peak_tree_hwm, now)
        if self.serving_hwm is not None:
            self.serving_hwm = max(self.serving_hwm, now)
        self._ticks += 1
        if self._gpu and self._ticks % 4 == 1:  # once a second: nvidia-smi itself takes ~50 ms
            used, source = self._device_bytes({p.pid for p in procs})
            if used > self.peak_device:
                self.peak_device, self.device_source = used, source

    def mark_loaded(self) -> None:
        """The engine is ready: its high-water mark so far is that of loading and starting."""
        self._sample()
        self.load_hwm = self.peak_tree_hwm

    def begin_serving(self) -> None:
        """Reset the tree's kernel high-water marks (/proc/PID/clear_refs, "5"): what follows is measured
        apart from what came before (the quality stage's prompt scoring, an evaluation artifact)."""
        self._sample()
        try:
            root = psutil.Process(self.root_pid)
            procs = root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                with open(f"/proc/{p.pid}/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                return  # cannot reset: serving_peak stays the whole life's peak
        self.serving_hwm = 0
        self._sample()

    @property
    def serving_peak(self) -> int:
        """Peak while loading and serving: the load phase's high-water mark and the one since
        begin_serving; the whole life's when the phases were not marked."""
        if self.serving_hwm is None or self.load_hwm is None:
            return self.peak_tree_hwm
        return max(self.load_hwm, self.serving_hwm)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> MemorySampler:
        threading.Thread(target=self._loop, daemon=True).start()
        return self

    def stop(self) -> None:
        self._sample()
        self._stop.set()
