"""Issue 6 asks for at least 200 hand-picked bad inputs checked into tests/: count them (without ../shared)."""

from __future__ import annotations

import test_bad_models
import test_bad_specs
import test_cli_errors
from bad_inputs.models import CASES

# Corruptions the issue lists, each covered by at least one model case (id prefix or word).
MODEL_KINDS = ("bytes-truncated", "bytes-ff", "arity-", "attr-epsilon-int", "attr-data-format-int", "epsilon-nan",
               "epsilon-negative", "epsilon-zero", "rank-0", "rank-1", "zero-channels", "huge-dimensions",
               "data-format-unknown", "duplicate-node-names", "duplicate-value-name", "missing-initializer",
               "if-branch", "function-")


def test_at_least_200_bad_inputs():
    specs, models, cli = (test_bad_specs.core_case_count(), test_bad_models.core_case_count(),
                          test_cli_errors.core_case_count())
    assert specs >= 150 and models >= 90 and cli >= 60, (specs, models, cli)
    assert specs + models + cli >= 200


def test_every_listed_model_corruption_is_covered():
    ids = [c.id for c in CASES]
    assert all(any(kind in i for i in ids) for kind in MODEL_KINDS), [
        k for k in MODEL_KINDS if not any(k in i for i in ids)]
