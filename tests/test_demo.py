"""``oplower demo``: no arguments, no files; every dialect lowered, run and compared; exit 0."""

from __future__ import annotations

import pytest

import lowering.demo
from lowering.cli import main


def test_demo_runs_every_dialect_and_passes(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for needle in ("onednn", "opset_v0", "ngraph", "directml", "NXC", "NCX", "bf16", "f16", "frozen"):
        assert needle in out
    verdicts = [line for line in out.splitlines() if "max abs err" in line]
    assert len(verdicts) >= 12 and all(line.endswith("PASS") for line in verdicts)
    assert "all outputs match the float64 reference" in out
    assert list(tmp_path.iterdir()) == []  # no files written


def test_demo_takes_no_arguments():
    with pytest.raises(SystemExit) as exc:
        main(["demo", "extra"])
    assert exc.value.code == 2


def test_demo_exits_1_when_a_comparison_fails(monkeypatch, capsys):
    real = lowering.demo.compare

    def strict(name, reference, got, elem_type, rel=1e-5):
        return real(name, reference, got, elem_type, rel=0.0) if name == "diff_beta" else real(
            name, reference, got, elem_type, rel)

    monkeypatch.setattr(lowering.demo, "compare", strict)
    assert lowering.demo.run_demo() == 1
    assert "out of tolerance" in capsys.readouterr().out
