"""The run folder and atomic writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.runstore import atomic_dir, open_run


def test_run_folder_is_absolute_whatever_the_cwd(tmp_path, monkeypatch):
    """A relative runs_dir is resolved where the user started the run: the quantize worker runs from
    the repository's root and once got a relative path that did not exist there."""
    monkeypatch.chdir(tmp_path)
    run, resumed = open_run(Path("runs"), "r", "h")
    assert run.root.is_absolute() and run.root.parent == tmp_path / "runs" and not resumed


def test_atomic_dir_publishes_whole_or_not_at_all(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
        assert not target.exists()  # nothing visible while it is written
    assert (target / "a").read_text() == "1"
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError("killed mid-write")
    assert (target / "a").read_text() == "1" and not list(tmp_path.glob("ckpt.tmp*"))
    with atomic_dir(tmp_path / "empty"):
        pass  # a producer with nothing to write publishes nothing
    assert not (tmp_path / "empty").exists()
    with atomic_dir(target, replace=False) as tmp:
        (tmp / "a").write_text("3")
    assert (target / "a").read_text() == "1"  # kept: another writer published it first


def test_a_dead_writers_half_folder_is_swept(tmp_path):
    dead = tmp_path / "ckpt.tmp999999999"
    dead.mkdir()
    with atomic_dir(tmp_path / "ckpt") as tmp:
        (tmp / "a").write_text("1")
    assert not dead.exists()
