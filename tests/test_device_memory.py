"""GPU device memory attribution, against a stand-in nvidia-smi (no GPU here or in CI): the
sampler counts the engine tree's own processes, and when nvidia-smi cannot see their PIDs (a
container's PID namespace) it falls back to the whole GPU above what was in use before."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.engines.memory import PER_PROCESS, WHOLE_DEVICE, MemorySampler, device_used_bytes

FAKE = """#!/usr/bin/env python3
import os, sys
args = " ".join(sys.argv[1:])
assert "--format=csv,noheader,nounits" in args, args
name = "apps" if "--query-compute-apps=pid,used_memory" in args else "gpus"
assert name == "apps" or "--query-gpu=index,uuid,memory.used" in args, args
sys.stdout.write(open(os.path.join(os.environ["FAKE_SMI_DIR"], name)).read())
"""


@pytest.fixture
def smi(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-smi"
    exe.write_text(FAKE)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SMI_DIR", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def write(apps: str, gpus: str) -> None:
        (tmp_path / "apps").write_text(apps)
        (tmp_path / "gpus").write_text(gpus)
    return write


@pytest.fixture
def tree():
    """A guard process with one child, like the engine tree (the root is the guard)."""
    root = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])"])
    for _ in range(100):
        kids = psutil.Process(root.pid).children(recursive=True)
        if kids:
            break
        time.sleep(0.05)
    yield root.pid, kids[0].pid
    for k in kids:
        k.kill()
    root.kill()
    root.wait()


def test_device_memory_of_the_engine_tree_only(smi, tree):
    root, child = tree
    smi(f"{child}, 1234\n999999, 5000\n", "0, GPU-a, 7000\n")
    m = MemorySampler(root, device_before=0, _gpu=True)
    m._sample()
    assert (m.peak_device, m.device_source) == (1234 * 2**20, PER_PROCESS)


def test_pids_hidden_by_a_namespace_fall_back_to_the_whole_device(smi, tree, monkeypatch):
    root, _ = tree
    smi("", "0, GPU-a, 1000\n1, GPU-b, 500\n")
    before = device_used_bytes()
    assert before == 1500 * 2**20
    m = MemorySampler(root, device_before=before, _gpu=True)
    m._sample()
    assert (m.peak_device, m.device_source) == (0, None)  # nothing runs on the GPU yet
    smi("", "0, GPU-a, 1800\n1, GPU-b, 500\n")  # no process listed at all, yet memory in use rose
    m._ticks = 0
    m._sample()
    assert (m.peak_device, m.device_source) == (800 * 2**20, WHOLE_DEVICE)
    smi("4242, 3000\n", "0, GPU-a, 3500\n1, GPU-b, 500\n")  # a PID nvidia-smi sees, not ours
    m._ticks = 0
    m._sample()
    assert (m.peak_device, m.device_source) == (2500 * 2**20, WHOLE_DEVICE)
    smi(f"{root}, [N/A]\n", "0, GPU-a, 4000\n1, GPU-b, 500\n")  # ours, but no per-process figure
    m._ticks = 0
    m._sample()
    assert (m.peak_device, m.device_source) == (3000 * 2**20, WHOLE_DEVICE)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-b")  # only the GPUs the engine may use count
    assert device_used_bytes() == 500 * 2**20


def test_no_nvidia_smi_means_no_device_figure(tree, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    m = MemorySampler(tree[0], device_before=None, _gpu=True)
    m._sample()
    assert (m.peak_device, m.device_source) == (0, None) and m.peak_tree_rss > 0
    assert device_used_bytes() is None


def test_serving_peak_leaves_out_what_came_between_loading_and_serving(tmp_path):
    """Kernel high-water marks (VmHWM) catch a spike no sampling sees; the marks reset before the
    systems stage, so the quality stage's scoring spike is not the budget's peak."""
    go = tmp_path / "go"
    child = ("import os, time\n"
             "x = bytearray(64 * 2**20)\n"  # loading: 64 MiB held
             f"while not os.path.exists({str(go)!r} + '1'): time.sleep(0.02)\n"
             "y = bytearray(400 * 2**20); del y\n"  # scoring: a 400 MiB spike, gone before any sample
             f"open({str(go)!r} + '2', 'w').close()\n"
             f"while not os.path.exists({str(go)!r} + '3'): time.sleep(0.02)\n"
             "z = bytearray(128 * 2**20); del z\n"  # serving: a 128 MiB spike
             f"open({str(go)!r} + '4', 'w').close()\n"
             "time.sleep(30)\n")
    root = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                             f"{child!r}])"])

    def wait_for(path: Path) -> None:
        for _ in range(500):
            if path.exists():
                return
            time.sleep(0.02)
        raise AssertionError(f"{path} never appeared")

    try:
        m = MemorySampler(root.pid, interval=3600, _gpu=False)  # no sampling thread: samples only when told
        time.sleep(1.0)
        m.mark_loaded()
        loaded = m.load_hwm
        (tmp_path / "go1").touch()
        wait_for(tmp_path / "go2")
        m.begin_serving()  # after the scoring spike
        (tmp_path / "go3").touch()
        wait_for(tmp_path / "go4")
        m.stop()
        assert m.peak_tree_hwm >= loaded + 380 * 2**20  # the whole life saw the scoring spike
        assert loaded + 100 * 2**20 <= m.serving_peak < loaded + 300 * 2**20  # serving: its own spike only
        assert m.peak_tree_rss < loaded + 100 * 2**20  # sampling missed both spikes
    finally:
        for p in psutil.Process(root.pid).children(recursive=True):
            p.kill()
        root.kill()
        root.wait()


def test_a_helper_that_exited_is_not_summed_with_what_came_after(tmp_path):
    """vLLM inspects a model's class in a subprocess that imports torch and exits before the engine loads;
    its high-water mark was never resident beside the engine's, so the tree's peak must not add the two
    (summing every mark ever seen put a baseline over its budget on the AVX2 kind)."""
    # Each process says when it holds its memory (a file), and the helper waits to be told to exit: on a
    # loaded host a fixed sleep sampled the helper before it had touched all of its pages.
    helper_ready, helper_go, engine_ready = (tmp_path / n for n in ("helper", "go", "engine"))
    helper = (f"import pathlib, time; x = bytearray(300 * 2**20); pathlib.Path({str(helper_ready)!r}).touch()\n"
              f"while not pathlib.Path({str(helper_go)!r}).exists(): time.sleep(0.05)")
    engine = (f"import pathlib, time; x = bytearray(200 * 2**20); pathlib.Path({str(engine_ready)!r}).touch()\n"
              "time.sleep(60)")
    root = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                             f"subprocess.run([sys.executable, '-c', {helper!r}]); "
                             f"subprocess.run([sys.executable, '-c', {engine!r}])"])

    def wait_for(path):
        for _ in range(1200):
            if path.exists():
                return
            time.sleep(0.05)
        raise AssertionError(f"{path.name} never held its memory")

    try:
        m = MemorySampler(root.pid, interval=3600, _gpu=False)  # samples only when told
        wait_for(helper_ready)
        m._sample()  # the helper alone, at its peak
        helper_peak = m.peak_tree_hwm
        assert helper_peak >= 300 * 2**20
        helper_go.touch()
        wait_for(engine_ready)
        m._sample()
        m.stop()
        assert m.peak_tree_hwm < helper_peak + 150 * 2**20, (m.peak_tree_hwm, helper_peak)
    finally:
        for p in psutil.Process(root.pid).children(recursive=True):
            p.kill()
        root.kill()
        root.wait()
