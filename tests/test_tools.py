"""The measurement scripts under tools/ that need torch (docs/numerics.md, docs/performance.md) at least parse their
arguments and import against the current package without it, so they do not rot between measurements."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.mark.parametrize("script", ["peer_ab.py", "accuracy_vs_torch.py"])
def test_tool_help_runs_without_torch(script):
    done = subprocess.run([sys.executable, str(TOOLS / script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=TOOLS.parent)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "torch" in done.stdout


def test_artifact_agreement_prints_one_row_per_artifact():
    """tools/ort_training/artifact_agreement.py (the numbers of the issue-19 report): the rows are the tests'
    own measures, within the tests' tolerances on an artifact every op of which has a rule."""
    env = {**os.environ, "PYTHONPATH": str(TOOLS.parent)}
    done = subprocess.run([sys.executable, str(TOOLS / "ort_training" / "artifact_agreement.py"), "mlp", "cnn1d"],
                          capture_output=True, text=True, timeout=300, cwd=TOOLS.parent, env=env)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()[2:]]
    assert [r[0].strip() for r in rows] == ["mlp", "cnn1d"]
    for row in rows:
        loss, gradient, parameter, curve = (float(v) for v in row[2:])
        assert loss <= 1e-5 and gradient <= 1e-4 and parameter <= 1e-5 and curve <= 1e-4, row
