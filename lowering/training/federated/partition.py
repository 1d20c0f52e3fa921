"""Split one data file into N client partitions, for trying federated training out.

The data is in ``oplower train --data``'s format (one array per data input, with a leading batch-index axis,
or one batch of the input's own rank). Its samples (every batch's rows, in order) are dealt out to the clients:

- IID (``alpha=None``): the samples shuffled, then dealt as whole batches, as evenly as the batch count
  allows (the first clients get one batch more when it does not divide);
- by label (``alpha`` given): for every class, the shares of its samples that go to each client are drawn
  from a Dirichlet distribution with concentration ``alpha`` (small alpha: each client sees few classes;
  large alpha: close to IID); needs a class-label input with one label per sample.

Each partition holds whole batches of the training model's batch size (leftover samples of a client are
dropped); a by-label draw that leaves a client without one whole batch is drawn again (up to 100 times).
Deterministic for a given ``seed``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from lowering.training.federated import FederatedError
from lowering.training.trainer import TrainingModels

REDRAWS = 100


def samples_of(data: Mapping[str, np.ndarray], models: TrainingModels, frozen: Iterable[str],
               source: str) -> tuple[dict, int]:
    """The data as samples (the batch-index axis merged into the batch axis) and the batch size; ``frozen``:
    the inputs the global model gives (not data)."""
    types = {i.name: i.type.tensor_type for i in models.training.graph.input}
    frozen = set(frozen)
    data_inputs = [n for n in models.other_inputs if n not in frozen]
    missing = [n for n in data_inputs if n not in data]
    if missing:
        raise FederatedError(f"{source}: no array for the data input {missing[0]!r}")
    extra = [k for k in data if k not in data_inputs]
    if extra:
        raise FederatedError(f"{source}: {extra[0]!r} is no data input of the training model (they are: "
                             f"{', '.join(data_inputs)})")
    samples, batch = {}, None
    for name in data_inputs:
        value = np.asarray(data[name])
        dims = [d.dim_value if d.HasField("dim_value") else None for d in types[name].shape.dim]
        if not dims:
            raise FederatedError(f"{source}: {name!r} is a scalar input; it cannot be split into samples")
        if value.ndim == len(dims) + 1:
            value = value.reshape(value.shape[0] * value.shape[1], *value.shape[2:])
        elif value.ndim != len(dims):
            raise FederatedError(f"{source}: {name!r} has shape {list(value.shape)}; expected the input's rank "
                                 f"{len(dims)} (one batch) or a leading batch-index axis over it")
        samples[name] = value
        if batch is None:
            batch = dims[0] or (np.asarray(data[name]).shape[1] if np.asarray(data[name]).ndim == len(dims) + 1
                                else value.shape[0])
    counts = {v.shape[0] for v in samples.values()}
    if len(counts) > 1:
        raise FederatedError(f"{source}: the arrays hold different numbers of samples ({sorted(counts)})")
    return samples, int(batch)


def split(data: Mapping[str, np.ndarray], models: TrainingModels, clients: int, *, frozen: Iterable[str] = (),
          alpha: float | None = None, seed: int = 0, source: str = "data") -> list[dict[str, np.ndarray]]:
    """``clients`` partitions of ``data`` (see the module docstring), each with a leading batch-index axis;
    ``frozen``: the inputs the global model gives (not data)."""
    if clients < 1:
        raise FederatedError(f"{clients} clients: need 1 or more")
    if alpha is not None and not (np.isfinite(alpha) and alpha > 0):
        raise FederatedError(f"Dirichlet alpha {alpha}: must be finite and > 0")
    samples, batch = samples_of(data, models, frozen, source)
    total = next(iter(samples.values())).shape[0]
    rng = np.random.default_rng(seed)
    if alpha is None:
        batches = total // batch
        if batches < clients:
            raise FederatedError(f"{source}: {total} samples make {batches} batches of {batch}; too few for "
                                 f"{clients} clients (each needs one batch)")
        order = rng.permutation(total)[:batches * batch]
        shares = [batches // clients + (1 if k < batches % clients else 0) for k in range(clients)]
        bounds = np.cumsum([0, *shares]) * batch
        picks = [order[bounds[k]:bounds[k + 1]] for k in range(clients)]
    else:
        picks = _by_label(samples, models, clients, alpha, batch, rng, source)
    return [{name: value[idx].reshape(len(idx) // batch, batch, *value.shape[1:]) for name, value in samples.items()}
            for idx in picks]


def _by_label(samples: dict, models: TrainingModels, clients: int, alpha: float, batch: int,
              rng: np.random.Generator, source: str) -> list[np.ndarray]:
    label = next((lab for lab in models.labels if lab.name in samples), None)
    if label is None:
        raise FederatedError(f"{source}: a split by label needs a class-label input (the training model has none; "
                             "split IID instead)")
    labels = samples[label.name]
    if labels.ndim != 1:
        raise FederatedError(f"{source}: a split by label needs one class label per sample; {label.name!r} holds "
                             f"{list(labels.shape[1:])} per sample")
    classes = np.unique(labels)
    by_class = {c: rng.permutation(np.flatnonzero(labels == c)) for c in classes}
    for _ in range(REDRAWS):
        owned: list[list[int]] = [[] for _ in range(clients)]
        for c in classes:
            members = by_class[c]
            shares = rng.dirichlet(np.full(clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for k, part in enumerate(np.split(members, cuts)):
                owned[k].extend(part.tolist())
        if all(len(o) >= batch for o in owned):
            picks = []
            for o in owned:
                o = rng.permutation(np.asarray(o, dtype=np.int64))
                picks.append(o[:len(o) // batch * batch])
            return picks
    raise FederatedError(f"{source}: {len(labels)} samples by label with Dirichlet alpha {alpha} leave a client "
                         f"without one batch of {batch} in {REDRAWS} draws; use fewer clients or a larger alpha")
