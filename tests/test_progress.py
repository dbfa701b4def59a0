"""Progress lines: a line every ~10 s in a log, a redrawn bar on a terminal, nothing with --quiet."""

from __future__ import annotations

import io
import time

from pipeline import progress
from pipeline.progress import Heartbeat, Progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_every_10_seconds_with_done_total_rate_and_eta(monkeypatch):
    monkeypatch.delenv(progress.QUIET_ENV, raising=False)
    out, clock = io.StringIO(), Clock()
    bar = Progress("quality: piqa, siqa", 1000, "prompts scored", "baseline", stream=out, clock=clock)
    for _ in range(100):  # 100 prompts in 5 s: too soon for a line
        clock.t += 0.05
        bar.advance()
    assert out.getvalue() == ""
    clock.t = 10.0
    bar.advance(100)  # 200 done at 10 s
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        "baseline | quality: piqa, siqa: 200/1000 prompts scored (20%), 20.0/s, ETA 40 s")
    clock.t = 15.0
    bar.advance()
    assert len(out.getvalue().splitlines()) == 1  # at most one line per 10 s
    bar.close()
    assert len(out.getvalue().splitlines()) == 1  # the stage's own summary line follows, not another


def test_a_terminal_gets_one_redrawn_bar(monkeypatch):
    monkeypatch.delenv(progress.QUIET_ENV, raising=False)
    out, clock = Tty(), Clock()
    with Progress("latency 256/64 c=4", 48, "requests", "awq", stream=out, clock=clock) as bar:
        for _ in range(48):
            clock.t += 0.5
            bar.advance()
    text = out.getvalue()
    assert text.count("\r") == 49 and text.endswith("\n") and "[########################] latency 256/64 c=4: 48/48" in text


def test_quiet_shows_no_progress(monkeypatch):
    monkeypatch.setenv(progress.QUIET_ENV, "1")
    out, clock = io.StringIO(), Clock()
    bar = Progress("drift", 8, "windows", stream=out, clock=clock)
    clock.t = 60.0
    bar.advance(8)
    bar.close()
    assert out.getvalue() == ""


def test_a_step_without_a_count_still_says_it_is_alive(monkeypatch):
    monkeypatch.delenv(progress.QUIET_ENV, raising=False)
    out = io.StringIO()
    with Heartbeat("quantization", "awq", every=0.3, stream=out):
        time.sleep(1.0)
    lines = out.getvalue().splitlines()
    assert 2 <= len(lines) <= 4 and all("awq | quantization: " in ln and "s so far" in ln for ln in lines)


def test_a_subprocess_step_shows_done_total_read_from_its_log(monkeypatch, tmp_path):
    from pipeline.setup.envs import log_counter

    monkeypatch.delenv(progress.QUIET_ENV, raising=False)
    log = tmp_path / "sensitivity.log"
    log.write_text("loading\nsensitivity 1/37 model.layers.0: KL 0.01\nsensitivity 12/37 model.layers.11: KL 0.03\n")
    out = io.StringIO()
    with Heartbeat("sensitivity", "search", every=0.3, stream=out,
                   count=log_counter(log, r"sensitivity (\d+)/(\d+) "), unit="parts"):
        time.sleep(1.0)
    lines = out.getvalue().splitlines()
    assert lines and all("search | sensitivity: 12/37 parts (32%)" in ln and "ETA" in ln for ln in lines)
    assert log_counter(tmp_path / "missing.log", r"(\d+)/(\d+)")() is None
    # llm-compressor's sequential pipeline, as its tqdm bars reach the quantize log (carriage returns)
    from pipeline.stages.quantize import PROGRESS

    log.write_text("(1/31): Calibrating: 100%|##########| 8/8 [00:01<00:00]\r(1/31): Propagating:  50%|#####| 4/8"
                   "\r(1/31): Propagating: 100%|##########| 8/8\n2026-12-01 | AWQ | INFO - smoothing\n"
                   "(2/31): Calibrating:  12%|#         | 1/8 [00:00<00:03]\r")
    assert log_counter(log, PROGRESS)() == (2, 31)
    # SmoothQuant then GPTQ: two passes over the 31 subgraphs, counted as one run of 62
    with open(log, "a") as f:
        f.write("(31/31): Propagating: 100%|##########| 8/8\r(1/31): Calibrating:   0%|\r(4/31): Calibrating: 50%|")
    assert log_counter(log, PROGRESS, passes=2)() == (31 + 4, 62)
    assert log_counter(log, PROGRESS, passes=1)() == (35, 62)  # more passes than expected: as many as seen


def test_a_step_where_nothing_completes_still_gets_its_line(monkeypatch):
    """A first request that takes long: the bar, used as a context manager, writes its line on time
    anyway (the run's console is never silent for longer than `every`), and stops when the step ends."""
    monkeypatch.delenv(progress.QUIET_ENV, raising=False)
    out = io.StringIO()
    with Progress("latency 256/64 c=4", 24, "requests", "baseline", every=0.2, stream=out):
        time.sleep(0.5)
    lines = out.getvalue().splitlines()
    assert 1 <= len(lines) <= 3 and lines[0].endswith("latency 256/64 c=4: 0/24 requests (0%), 0.0/s, ETA –")
    time.sleep(0.3)
    assert out.getvalue().splitlines() == lines  # nothing after the step


def test_consecutive_short_steps_never_add_up_to_a_long_silence(monkeypatch):
    """Each step quieter than a bar's cadence, one after another (a scoring pass, the A/A pass, drift): the
    console added their silences up past the 15 s a run may stay quiet. Silence is the console's, so the second bar speaks up
    as soon as the console has been quiet for the cadence, not a cadence after its own start."""
    monkeypatch.delenv(progress.QUIET_ENV, raising=False)
    out = io.StringIO()
    progress.printed()
    with Progress("first step", 10, "items", "baseline", every=2.0, stream=out):
        time.sleep(1.5)
    assert out.getvalue() == ""
    t0 = time.monotonic()
    with Progress("second step", 10, "items", "baseline", every=2.0, stream=out):
        while not out.getvalue() and time.monotonic() - t0 < 5:
            time.sleep(0.02)
    spoke = time.monotonic() - t0
    # about 0.5 s (its first tick finds the console quiet for 2 s); by its own cadence it would be 1.9 s
    assert "second step" in out.getvalue() and spoke < 1.4, spoke
