"""The `moecache` command line: subcommand list, not-yet-built commands, and bad-file errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moecache.cli.main import app

runner = CliRunner()


def test_help_lists_subcommands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("run", "serve", "bench", "probe-pcie", "profile", "perplexity", "info"):
        assert cmd in r.output


def test_info_on_bad_files_is_one_line_exit_1(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    r = subprocess.run([sys.executable, "-m", "moecache.cli.main", "info", "-m", str(bad)],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "not a GGUF file" in lines[0]
    r = runner.invoke(app, ["info", "-m", str(tmp_path / "missing.gguf")])
    assert r.exit_code == 1 and "no such file" in r.output


def test_info_on_real_model(code_moe_tiny):
    r = runner.invoke(app, ["info", "-m", str(code_moe_tiny)])
    assert r.exit_code == 0, r.output
    assert "qwen3moe" in r.output and "n_expert" in r.output


@pytest.mark.parametrize("flags,msg", [(["-ctk", "f16", "-ctv", "f32"], "different types"),
                                       (["-ctk", "q8_0", "-ctv", "q8_0"], "supported KV cache types are f32, f16")])
def test_kv_cache_type_flags_are_checked(tmp_path, flags, msg):
    r = runner.invoke(app, ["run", "-m", str(tmp_path / "any.gguf"), "-p", "hi", *flags])
    assert r.exit_code == 1 and msg in r.output


def test_the_cli_is_a_module_of_the_package():
    """The console script runs moecache.cli.main:app (no top-level `cli` package is installed), and
    importing the package or the CLI loads no heavy module (``--help`` stays instant)."""
    import tomllib
    from importlib.metadata import entry_points

    root = Path(__file__).resolve().parents[1]
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["moecache"] == "moecache.cli.main:app"
    assert meta["tool"]["setuptools"]["packages"]["find"]["include"] == ["moecache*"]
    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "moecache"]
    assert ep.value == "moecache.cli.main:app" and ep.load() is app
    code = "import sys, moecache.cli.main; print(sorted(m for m in ('numba', 'numpy', 'cupy') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
