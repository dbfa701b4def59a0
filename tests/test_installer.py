"""The environments' installer: pip's settings handed to uv, and pip taking over when uv fails."""

from __future__ import annotations

import io
import stat
import sys

from pipeline.setup import envs, installer

LISTING = """:env:.cert='/etc/ssl/certs/ca.crt'
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
:env:.find-links='/opt/wheels'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/opt/wheels /opt/more'
global.index-url='https://mirror.example/simple'
global.trusted-host='mirror.example'
:env:.cache-dir='/tmp/fresh/pip-cache'
:env:.proxy='http://proxy.example:3128'
install.index-url='https://inner.example/simple'
download.dest='/tmp/ignored'
"""


def test_pip_settings_are_read_as_pip_install_would_use_them():
    settings, unknown = installer.pip_settings(LISTING)
    assert unknown == []
    assert settings["find-links"] == ["/opt/wheels", "/opt/more"]  # one list, no repeats
    assert settings["extra-index-url"] == ["file:///opt/a/simple", "file:///opt/b/simple"]
    assert settings["index-url"] == "https://inner.example/simple"  # [install] over [global]
    assert settings["constraint"] == "/etc/pip/constraints.txt"
    assert "dest" not in settings  # another command's section


def test_uv_is_given_every_setting_that_changes_what_gets_installed():
    args, env = installer.uv_arguments(installer.pip_settings(LISTING)[0])
    joined = " ".join(args)
    assert "--index-strategy unsafe-best-match" in joined  # pip takes the best version of any index
    assert "--index-url https://inner.example/simple" in joined
    assert "--extra-index-url file:///opt/a/simple --extra-index-url file:///opt/b/simple" in joined
    assert "--find-links /opt/wheels --find-links /opt/more" in joined
    assert "--constraint /etc/pip/constraints.txt" in joined
    assert "--allow-insecure-host mirror.example" in joined
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca.crt", "UV_HTTP_TIMEOUT": "180",
                   "HTTP_PROXY": "http://proxy.example:3128", "HTTPS_PROXY": "http://proxy.example:3128"}
    assert "--no-index" in installer.uv_arguments({"no-index": "true"})[0]


def test_a_pip_setting_uv_cannot_be_given_means_pip(tmp_path, monkeypatch):
    monkeypatch.delenv("QUANTIZE_EVAL_INSTALLER", raising=False)
    monkeypatch.setattr(installer.Installer, "_pip_config",
                        lambda self: LISTING + "global.use-feature='truststore'\n")
    log = io.StringIO()
    chosen = installer.Installer(tmp_path / "tools", log)
    assert chosen.name == "pip" and chosen.uv is None
    assert "use-feature" in log.getvalue()
    assert not (tmp_path / "tools").exists()  # uv was not even installed


def test_the_environment_is_built_with_pip_when_uv_fails(tmp_path, monkeypatch, capsys):
    """A uv that fails (here a stand-in exiting 1) must not leave the user without an environment:
    the same requirements are installed again with pip, and the log says so."""
    monkeypatch.delenv("QUANTIZE_EVAL_INSTALLER", raising=False)
    monkeypatch.setenv("QUANTIZE_EVAL_HOME", str(tmp_path / "home"))
    reqs = tmp_path / "requirements"
    reqs.mkdir()
    (reqs / "quantize.txt").write_text("# nothing to install\n")
    monkeypatch.setattr(envs, "REQUIREMENTS", reqs)
    monkeypatch.setitem(envs.SMOKE, "quantize", "import json")
    uv = tmp_path / "home" / "tools" / installer.UV.replace("==", "-") / "bin" / "uv"
    uv.parent.mkdir(parents=True)
    uv.write_text("#!/bin/sh\necho 'uv: refusing on purpose' >&2\nexit 1\n")
    uv.chmod(uv.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(installer.Installer, "_pip_config", lambda self: "")

    py = envs.ensure("quantize")

    assert py.exists() and (py.parent.parent / envs.READY).exists()
    log = (py.parent.parent.parent / f"{py.parent.parent.name}.log").read_text()
    assert "uv: refusing on purpose" in log and "building again with pip" in log
    assert "-m pip install -r" in log
    assert "environment ready (pip)" in capsys.readouterr().err
    assert envs.ensure("quantize") == py  # ready: found, not rebuilt


def test_quantize_eval_installer_pip_forces_pip(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTIZE_EVAL_INSTALLER", "pip")
    log = io.StringIO()
    chosen = installer.Installer(tmp_path / "tools", log)
    assert chosen.name == "pip" and "QUANTIZE_EVAL_INSTALLER=pip" in log.getvalue()


def test_the_smoke_test_caches_bytecode_even_where_python_is_told_not_to(tmp_path, monkeypatch):
    """uv does not compile bytecode at install and PYTHONDONTWRITEBYTECODE (set in many container and
    CI images) stops Python caching it, so without this every engine start compiles vLLM again. An
    environment built before the smoke test wrote bytecode gets it once, on its next use."""
    monkeypatch.setenv("QUANTIZE_EVAL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    reqs = tmp_path / "requirements"
    reqs.mkdir()
    (reqs / "quantize.txt").write_text("# nothing to install\n")
    monkeypatch.setattr(envs, "REQUIREMENTS", reqs)
    pkg = tmp_path / "src"
    pkg.mkdir()
    (pkg / "qe_probe_mod.py").write_text("X = 1\n")
    monkeypatch.setenv("PYTHONPATH", str(pkg))
    monkeypatch.setitem(envs.SMOKE, "quantize", "import qe_probe_mod")
    target = envs.env_dir("quantize")
    (target / "bin").mkdir(parents=True)
    (target / "bin" / "python").symlink_to(sys.executable)
    (target / envs.READY).write_text("built before bytecode was cached\n")  # an older environment

    assert envs.ensure("quantize") == target / "bin" / "python"

    assert list((pkg / "__pycache__").glob("qe_probe_mod.*.pyc")), "the smoke test wrote no bytecode"
    assert (target / envs.BYTECODE).exists()
    (pkg / "qe_probe_mod.py").unlink()  # a second use does not import again
    assert envs.ensure("quantize") == target / "bin" / "python"
