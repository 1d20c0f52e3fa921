"""The Flower apps in Flower's Simulation Engine on this machine (what ``oplower federate`` runs).

One virtual SuperNode per partition (partition-id k trains ``partitions[k]``); the ServerApp runs in a thread
of this process, the ClientApps in Ray actors, one CPU each (``cpus`` actors, default: every core), each
with ``threads`` onnxruntime threads (default 1, so that the actors do not compete for the cores). The global
model's start is read here before Ray starts, so that a bad artifact directory, parameter file or output path
fails at once.

Flower's and Ray's own logs are silenced unless ``verbose``; their telemetry and usage statistics are off
(``FLWR_TELEMETRY_ENABLED=0``, ``FLWR_DISABLE_UPDATE_CHECK=1``, ``RAY_USAGE_STATS_ENABLED=0``, unless set
otherwise): nothing is sent anywhere.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from lowering.training.federated import FederatedError, require_flower
from lowering.training.federated.local import PartitionError, global_start, read_partition

QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0",
             "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "RAY_DEDUP_LOGS": "0"}
# the server pulls replies from the in-memory state this often (cheap, unlike a deployed SuperLink's HTTP API):
# against Flower's 0.1 s, about 120 ms less per round of 10 clients on 2 CPUs (tools/federated_numbers.py speed)
POLL_SECONDS = 0.02


def federate(settings, partitions: Sequence[Path | str], *, threads: int | None = 1, cpus: int | None = None,
             initial: Mapping[str, np.ndarray] | None = None, on_round: Callable | None = None,
             on_progress: Callable[[str, int, int], None] | None = None, verbose: bool = False):
    """Run ``settings`` (a :class:`~lowering.training.federated.app.ServerSettings`) over ``partitions`` in
    the Simulation Engine; returns the :class:`~lowering.training.federated.app.FederatedResult`."""
    require_flower(simulation=True)
    if not partitions:
        raise FederatedError("no partitions: give each client's data with --partition P.npz (one per client) or "
                             "--split DATA.npz --clients N")
    settings.check()
    for p in partitions:
        if not Path(p).is_file():
            raise PartitionError(f"{p}: no such file" if not Path(p).exists() else f"{p}: not a file")
    if initial is None:
        params = read_partition(settings.params) if settings.params else None
        initial = global_start(settings.artifacts, params=params, params_source=settings.params,
                               checkpoint=settings.checkpoint or None, target=settings.target)
    cpus = max(1, min(cpus or os.cpu_count() or 1, len(partitions)))
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)

    from flwr.simulation import run_simulation  # noqa: PLC0415 -- Flower only when federating

    from lowering.training.federated.app import make_clientapp, make_serverapp, simulated_side  # noqa: PLC0415

    paths = tuple(str(Path(p).resolve()) for p in partitions)
    server = make_serverapp(replace(settings, artifacts=str(Path(settings.artifacts).resolve()),
                                    min_nodes=len(paths)),
                            initial=initial, on_round=on_round, on_progress=on_progress, poll=POLL_SECONDS)
    client = make_clientapp(functools.partial(simulated_side, str(Path(settings.artifacts).resolve()), paths,
                                              threads))
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": cpus, "num_gpus": 0, "include_dashboard": False,
                             "logging_level": "info" if verbose else "error", "log_to_driver": verbose}}
    with _quiet(verbose):
        run_simulation(server_app=server, client_app=client, num_supernodes=len(paths), backend_config=backend,
                       verbose_logging=verbose)
    result = getattr(server, "result", None)
    if result is None:
        raise FederatedError("the Simulation Engine ended without running the ServerApp (see --verbose)")
    return result


@contextlib.contextmanager
def _quiet(verbose: bool) -> Iterator[None]:
    """Flower's log at ERROR (its INFO lines and run_simulation's deprecation notice off) and Ray's
    FutureWarnings off, unless verbose."""
    logger = logging.getLogger("flwr")
    level = logger.level
    with warnings.catch_warnings():
        if not verbose:
            logger.setLevel(logging.ERROR)
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            yield
        finally:
            logger.setLevel(level)
