"""The measurement scripts under tools/ that need torch (docs/numerics.md, docs/performance.md) at least parse their
arguments and import against the current package without it, so they do not rot between measurements."""

from __future__ import annotations

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
