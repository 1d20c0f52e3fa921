import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"

# The parsed schema registry's disk cache (opdef/registry_cache.py) lives in a directory of this session's own, for
# the whole session and every process it starts: no test reads or writes the user's ~/.cache (or CI's $HOME). The
# first load parses and writes it, later loads and subprocesses read it; tests/test_registry_cache.py points it at
# its own tmp_path to exercise it.
_CACHE_HOME = tempfile.mkdtemp(prefix="oplower-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
atexit.register(shutil.rmtree, _CACHE_HOME, ignore_errors=True)

# Bounded hypothesis runs in CI; a developer can run more with HYPOTHESIS_PROFILE=dev.
settings.register_profile("ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


NO_SHARED = pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is absent: seeds/corpus tests need "
                                                          "../shared beside the project")


def pytest_collection_modifyitems(config, items):
    """Tests that read ../shared (they take the ``shared_dir`` fixture) are skipped, with the reason, only
    when it is absent; the core tests never need it."""
    for item in items:
        if "shared_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(NO_SHARED)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared beside the project (the seeds and the upstream corpus)."""
    return SHARED
