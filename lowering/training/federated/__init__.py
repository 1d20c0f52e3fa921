"""Federated training on Flower: many clients train one model, each on plain onnxruntime (issue 30).

Flower (``flwr``, the optional extra ``oplower[federated]``) does the orchestration: it samples clients,
ships them the global model, collects their updates and aggregates them with its own FedAvg
(``flwr.serverapp.strategy.FedAvg``), in its Simulation Engine or deployed (a SuperLink and one SuperNode
per device). oplower supplies the apps:

- ``local`` -- what a client does, without Flower: train an artifact directory on its partition from the
  global state (fresh optimizer state, ``local-epochs`` passes over its batches, exactly as ``oplower train
  DIR --params GLOBAL.npz --data PARTITION.npz --steps E*B --lr LR``), evaluate the global state on it,
  and the server's start and outputs (``--params`` / ``--checkpoint``, ``--save``, ``--save-checkpoint``,
  ``--export``);
- ``partition`` -- one data file split into N partitions, IID or by label with a Dirichlet alpha;
- ``app`` -- the Flower ClientApp (train and evaluate handlers) and ServerApp (FedAvg) over the Message
  API; its module-level ``clientapp`` and ``serverapp`` are what ``flwr run`` starts in a deployment;
- ``simulation`` -- the same apps in Flower's Simulation Engine on this machine (``oplower federate``).

Only ``app`` and ``simulation`` import Flower; this package and the other modules import without it.
"""

from __future__ import annotations

import importlib.util
import sys

from opdef.errors import OplowerError

EXTRA = "pip install 'oplower[federated]'"


class FederatedError(OplowerError):
    """A federated run that cannot start or finish (bad settings, no client trained in any round)."""


class FlowerMissingError(FederatedError):
    """Flower (or its Simulation Engine) is not installed."""


def require_flower(*, simulation: bool = True) -> None:
    """Raise FlowerMissingError, naming the extra, unless Flower (and for the Simulation Engine, Ray) imports."""
    if sys.version_info < (3, 11):
        raise FlowerMissingError(f"federated training needs Flower 1.42, which needs Python 3.11 or newer (this is "
                                 f"Python {sys.version_info.major}.{sys.version_info.minor})")
    missing = [name for name in ("flwr", *(("ray",) if simulation else ())) if not _importable(name)]
    if missing:
        what = "Flower" if missing[0] == "flwr" else "Flower's Simulation Engine (ray)"
        raise FlowerMissingError(f"federated training needs {what}, which is not installed: {EXTRA}")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules (blocked) or without a spec
        return False
