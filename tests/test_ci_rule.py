"""conftest.py's rule for reference inputs: a missing one skips outside CI and fails under CI
(``CI=true``, as .ci/run), whichever road the skip takes; GPU tests still skip.

Runs pytest in a subprocess on a scratch directory holding a copy of tests/conftest.py and test
files that need inputs nobody has, once with CI=true and once without, and reads each test's
outcome from the JUnit XML report.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

TESTS = '''
import pytest
from conftest import require_module, require_shared

def test_shared_model(): require_shared("no-such-model-4711.gguf")
def test_package(): require_module("no_such_package_4711")
def test_fixture(code_moe_tiny_missing): pass
def test_bare_skip(): pytest.skip("some other reason")
@pytest.mark.skipif(True, reason="a skipif")
def test_skipif(): pass
@pytest.mark.parametrize("x", [])
def test_empty_params(x): pass
@pytest.mark.xfail(reason="known")
def test_xfail(): assert False
@pytest.mark.gpu
def test_gpu(): pytest.skip("no GPU here")
def test_passes(): assert True

@pytest.fixture
def code_moe_tiny_missing():
    return require_shared("no-such-model-4711.gguf")
'''

MODULE_SKIP = '''
import pytest
torch = pytest.importorskip("no_such_package_4711")
def test_never_collected(): pass
'''


def _outcomes(tmp: Path, ci: str | None, file: str = "test_inputs.py") -> dict[str, str]:
    """{test name: passed | failed | error | skipped} of one run; collection errors by file name."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "MOECACHE_TEST_SEED")}
    if ci is not None:
        env["CI"] = ci
    xml = tmp / f"report-{ci}-{file}.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu or gpu",
                        f"--junitxml={xml}", "--rootdir", str(tmp), "-c", str(tmp / "pytest.ini"), file],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
    assert xml.exists(), r.stdout + r.stderr
    out = {}
    for case in ET.parse(xml).iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        out[case.get("name")] = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(
            kinds[0] if kinds else "", "passed")
    out["_rc"] = str(r.returncode)
    out["_output"] = r.stdout + r.stderr
    return out


def test_missing_inputs_fail_under_ci_and_skip_elsewhere(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    (tmp_path / "test_inputs.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "test_module_skip.py").write_text(textwrap.dedent(MODULE_SKIP))

    local = _outcomes(tmp_path, None)
    assert local["_rc"] == "0", local["_output"]
    for name in ("test_shared_model", "test_package", "test_fixture", "test_bare_skip", "test_skipif",
                 "test_empty_params[NOTSET]", "test_xfail", "test_gpu"):
        assert local[name] == "skipped", (name, local)
    assert local["test_passes"] == "passed"

    ci = _outcomes(tmp_path, "true")
    assert ci["_rc"] == "1", ci["_output"]
    for name in ("test_shared_model", "test_package", "test_bare_skip"):
        assert ci[name] == "failed", (name, ci)
    for name in ("test_fixture", "test_skipif", "test_empty_params[NOTSET]"):  # failed in setup: an error
        assert ci[name] == "error", (name, ci)
    assert "missing reference input under CI: no-such-model-4711.gguf" in ci["_output"]
    assert "skipped under CI: Skipped: some other reason" in ci["_output"]
    # an expected failure, and a GPU test on a machine without one, are not missing inputs
    assert ci["test_xfail"] == "skipped" and ci["test_gpu"] == "skipped"
    assert ci["test_passes"] == "passed"

    # a module skipped at import (importorskip at the top of a file) does not drop its tests silently
    assert _outcomes(tmp_path, None, "test_module_skip.py")["test_module_skip"] == "skipped"
    mod = _outcomes(tmp_path, "true", "test_module_skip.py")
    assert mod["test_module_skip"] == "error" and mod["_rc"] != "0", mod
    assert "skipped under CI" in mod["_output"] and "no_such_package_4711" in mod["_output"]

    for value in ("false", "0", ""):  # CI set to a false value is not CI
        assert _outcomes(tmp_path, value)["_rc"] == "0"
