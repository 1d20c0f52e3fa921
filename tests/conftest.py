import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"

# Bounded hypothesis runs in CI; a developer can run more with HYPOTHESIS_PROFILE=dev.
settings.register_profile("ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared beside the project; tests that need it skip with a clear reason when it is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent: seeds/corpus tests need ../shared beside the project")
    return SHARED
