"""The wheel carries the grammar, and planc runs from the wheel alone."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import PLANS, ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "--wheel-dir", str(out), str(ROOT)], check=True, timeout=300,
                   capture_output=True)
    (path,) = out.glob("planc-*.whl")
    return path


def test_wheel_holds_the_package_the_grammar_and_the_console_script(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        grammar = archive.read("planc/grammars/plan.lark").decode()
        entry_points = next(archive.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
    assert (ROOT / "grammars" / "plan.lark").read_text() == grammar
    assert {"planc/__init__.py", "planc/cli.py", "planc/lang/parser.py"} <= names
    assert "planc = planc.__main__:run" in entry_points
    assert not any(n.startswith("tests/") for n in names)


def test_planc_checks_a_plan_from_the_wheel_alone(wheel, tmp_path):
    # Only the wheel on the path (plus lark from site-packages): the grammar must come
    # from inside the package, not from the source checkout.
    env = {**os.environ, "PYTHONPATH": str(wheel), "PYTHONSAFEPATH": "1"}
    result = subprocess.run(
        [sys.executable, "-c", "import sys, planc.lang.parser as p; "
         "assert '.whl' in p.__file__, p.__file__; "
         "from planc.cli import main; sys.exit(main(['check', sys.argv[1]]))",
         str(PLANS / "gpt-tiny.plan")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "ok: plan gpt_tiny" in result.stdout
