"""The recorded onnxruntime-training one-node cases: ``ops/cases.json`` (the core ops) and every op family's
``ops/cases_<family>.json`` (tools/ort_training/cases_<family>.py), in one list."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ort_training"


def recorded_cases(*op_types: str) -> list[dict]:
    """Every recorded case (of ``op_types`` when given), the core index first, then the families by name."""
    indexes = [FIXTURES / "ops" / "cases.json", *sorted((FIXTURES / "ops").glob("cases_*.json"))]
    cases = [case for index in indexes for case in json.loads(index.read_text())]
    return [case for case in cases if not op_types or case["op_type"] in op_types]
