"""The Flower apps: a ClientApp that trains an artifact directory on plain onnxruntime, a ServerApp with FedAvg.

Flower's Message API throughout. The server sends each sampled client the global model as an ``ArrayRecord``
(every state tensor by name, in the artifacts' order: trainable parameters, then frozen values such as batch
norm's running statistics) and a ``ConfigRecord`` (``local-epochs``, ``lr``, ``target``, and FedAvg's
``server-round``). A client's train handler answers with the state after its local training
(:func:`lowering.training.federated.local.train_local`) and a ``MetricRecord`` (``num-examples``,
``train-loss``, ``steps``, ``seconds``); its evaluate handler with ``num-examples``, ``eval-loss``,
``accuracy`` (classification losses) and ``seconds``. Flower's own
``flwr.serverapp.strategy.FedAvg`` aggregates: the new global model is the example-weighted mean of every
state tensor the clients return, and the metrics are weighted the same way.

A client that cannot train (a bad partition, a missing file ...) answers with an ``Error`` whose reason is
the project's one-line error; FedAvg aggregates the other clients' updates, and the round's summary lists
the failure. ``_ReportingFedAvg`` only observes FedAvg (what was sampled, which replies failed, the round's
time) to report each round; sampling and aggregation are FedAvg's.

Deployment (``flwr run``): the module-level ``serverapp`` reads its settings from the run config (keys in
``RUN_CONFIG``), ``clientapp`` reads its partition (and optionally ``artifacts``, ``threads``) from the
SuperNode's node config. The Simulation Engine (:mod:`lowering.training.federated.simulation`) builds the
same apps with :func:`make_clientapp` / :func:`make_serverapp`.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from lowering.modelio import write_atomic
from lowering.training.federated import FederatedError
from lowering.training.federated.local import (
    check_outputs_writable,
    evaluate_local,
    export_outputs_of,
    global_start,
    npz_bytes,
    read_partition,
    train_local,
    write_global,
)
from opdef.errors import OplowerError

# the run config of a deployment (pyproject.toml's [tool.flwr.app.config], `flwr run --run-config`); "" = unset
RUN_CONFIG = {
    "artifacts": "", "rounds": 3, "local-epochs": 1, "lr": 1e-3, "fraction-train": 1.0, "fraction-evaluate": 1.0,
    "min-nodes": 2,
    "params": "", "checkpoint": "", "save": "", "save-checkpoint": "", "export": "", "save-rounds": "",
    "target": "onnxruntime", "round-timeout": 600.0, "seed": 0,
}
OUR_ERROR = "oplower: "  # an Error reason a client made from one of the project's errors
POLL_SECONDS = 0.1  # how often the server pulls replies (deployed: an HTTP request to the SuperLink each)


# -- the client ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientSide:
    """What a client trains on: the artifact directory and its partition, and its onnxruntime threads."""

    artifacts: str
    partition: str
    threads: int | None = None


def client_side_from_context(context: Context) -> ClientSide:
    """A deployed SuperNode's settings: ``partition`` (and optionally ``artifacts``, ``threads``) from its node
    config (``flower-supernode --node-config 'partition="p1.npz"'``), ``artifacts`` else from the run config."""
    node, run = context.node_config, context.run_config
    partition = str(node.get("partition", ""))
    artifacts = str(node.get("artifacts", "") or run.get("artifacts", ""))
    if not partition:
        raise FederatedError("this SuperNode has no partition: start it with --node-config 'partition=\"P.npz\"'")
    if not artifacts:
        raise FederatedError("no artifact directory: set 'artifacts' in the run config or the node config")
    threads = int(node.get("threads", 0) or 0) or None
    return ClientSide(artifacts, partition, threads)


def simulated_side(artifacts: str, partitions: tuple[str, ...], threads: int | None, context: Context) -> ClientSide:
    """A virtual SuperNode of the Simulation Engine: partition ``partition-id`` of ``partitions``."""
    return ClientSide(artifacts, partitions[int(context.node_config["partition-id"])], threads)


def make_clientapp(side: Callable[[Context], ClientSide]) -> ClientApp:
    """The ClientApp: train and evaluate handlers over the artifact directory ``side(context)`` names."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        try:
            where = side(context)
            config = message.content["config"]
            state = _state(message.content["arrays"])
            result = train_local(where.artifacts, state, where.partition, epochs=int(config["local-epochs"]),
                                 learning_rate=float(config["lr"]), threads=where.threads,
                                 target=str(config.get("target", "onnxruntime")))
        except Exception as exc:  # noqa: BLE001 -- every failure becomes this client's error reply
            return _error_reply(message, exc)
        metrics = MetricRecord({"num-examples": result.examples, "train-loss": result.loss, "steps": result.steps,
                                "seconds": result.seconds})
        return Message(RecordDict({"arrays": _record(result.state), "metrics": metrics}), reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        try:
            where = side(context)
            config = message.content["config"]
            result = evaluate_local(where.artifacts, _state(message.content["arrays"]), where.partition,
                                    threads=where.threads, target=str(config.get("target", "onnxruntime")))
        except Exception as exc:  # noqa: BLE001
            return _error_reply(message, exc)
        values = {"num-examples": result.examples, "eval-loss": result.loss, "seconds": result.seconds}
        if result.accuracy is not None:
            values["accuracy"] = result.accuracy
        return Message(RecordDict({"metrics": MetricRecord(values)}), reply_to=message)

    return app


def _state(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


def _record(state: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(value)) for name, value in state.items()})


def _error_reply(message: Message, exc: BaseException) -> Message:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, OplowerError):
        text = f"internal error: {type(exc).__name__}: {text}"
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=OUR_ERROR + text), reply_to=message)


# -- the server ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSettings:
    """A federated run: the artifacts, the rounds, what each client does and what is written at the end."""

    artifacts: str
    rounds: int
    local_epochs: int = 1
    learning_rate: float = 1e-3
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0  # 0: no federated evaluation
    min_nodes: int = 1  # connected nodes to wait for before round 1 (FedAvg itself then needs 1)
    params: str = ""  # where the global model starts: an .npz by name, else a checkpoint, else DIR/checkpoint
    checkpoint: str = ""
    save: str = ""
    save_checkpoint: str = ""
    export: str = ""
    save_rounds: str = ""  # a directory: the global model after each round, round-<r>.npz
    target: str = "onnxruntime"
    round_timeout: float = 600.0  # seconds FedAvg waits for a phase's replies (missing ones count as failed)
    seed: int | None = 0  # client sampling (Python's random, which FedAvg's sampling uses): the same nodes, the same
    # sample; the Simulation Engine's virtual nodes get new ids each run, so there only the split is reproduced

    def check(self) -> None:
        """The one-line errors of settings that cannot run, before anything starts."""
        if not self.artifacts:
            raise FederatedError("no artifact directory given")
        if self.rounds < 1:
            raise FederatedError(f"{self.rounds} rounds: the round count must be 1 or more")
        if self.local_epochs < 1:
            raise FederatedError(f"{self.local_epochs} local epochs: must be 1 or more")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise FederatedError(f"learning rate {self.learning_rate}: must be finite and > 0")
        if not (0 < self.fraction_train <= 1):
            raise FederatedError(f"fraction of clients to train {self.fraction_train}: must be in (0, 1]")
        if not (0 <= self.fraction_evaluate <= 1):
            raise FederatedError(f"fraction of clients to evaluate {self.fraction_evaluate}: must be in [0, 1]")
        if self.params and self.checkpoint:
            raise FederatedError("give the starting point as params or as a checkpoint, not both")
        if self.save_rounds and not Path(self.save_rounds).is_dir():
            raise FederatedError(f"{self.save_rounds}: not a directory (the global model of each round goes there)")
        check_outputs_writable((self.save, self.save_checkpoint, self.export))


def server_settings_from_config(run: Mapping[str, object]) -> ServerSettings:
    """The ServerApp's settings from a deployment's run config (keys of ``RUN_CONFIG``)."""
    unknown = sorted(set(run) - set(RUN_CONFIG))
    if unknown:
        raise FederatedError(f"run config: unknown key {unknown[0]!r} (known: {', '.join(RUN_CONFIG)})")
    c = {**RUN_CONFIG, **run}
    seed = int(c["seed"])
    return ServerSettings(
        str(c["artifacts"]), int(c["rounds"]), int(c["local-epochs"]), float(c["lr"]), float(c["fraction-train"]),
        float(c["fraction-evaluate"]), int(c["min-nodes"]), str(c["params"]), str(c["checkpoint"]), str(c["save"]),
        str(c["save-checkpoint"]), str(c["export"]), str(c["save-rounds"]), str(c["target"]),
        float(c["round-timeout"]), None if seed < 0 else seed)


@dataclass
class RoundSummary:
    """One round as the server saw it."""

    round: int
    rounds: int
    sampled: int = 0
    trained: int = 0
    failures: list[str] = field(default_factory=list)  # one line per client that did not train
    train_loss: float | None = None  # example-weighted mean of the clients' mean losses
    evaluated: int = 0
    eval_sampled: int = 0
    eval_failures: list[str] = field(default_factory=list)
    eval_loss: float | None = None  # example-weighted
    accuracy: float | None = None
    seconds: float = 0.0  # the whole round (train and evaluate), wall clock
    client_seconds: float = 0.0  # the clients' own time in their handlers (train and evaluate), summed
    train_seconds: float = 0.0  # the train handlers' time, summed
    started: float = 0.0

    def lines(self) -> list[str]:
        """What ``oplower federate`` prints for the round: one line, then one per failed client."""
        width = len(str(self.rounds))
        failed = f", {len(self.failures)} failed" if self.failures else ""
        text = f"round {self.round:>{width}}/{self.rounds}: {self.trained} of {self.sampled} clients trained{failed}"
        text += f", train loss {self.train_loss:.6g}" if self.train_loss is not None else ", global model unchanged"
        if self.eval_loss is not None:
            text += f", eval loss {self.eval_loss:.6g}"
            if self.accuracy is not None:
                text += f" accuracy {self.accuracy:.4g}"
            text += f" ({self.evaluated} client{'s' if self.evaluated != 1 else ''})"
        else:
            text += ", no evaluation"
        out = [text]
        out += [f"  client failed: {reason}" for reason in self.failures]
        train_reasons = set(self.failures)
        out += [f"  client failed (evaluate): {reason}" for reason in self.eval_failures if reason not in train_reasons]
        return out


def _reason(reply: Message) -> str:
    reason = " ".join(str(reply.error.reason or "").split()) or f"error code {reply.error.code}"
    if reason.startswith(OUR_ERROR):
        return reason[len(OUR_ERROR):]
    return f"node {reply.metadata.src_node_id}: {reason[:300]}"


def _reply_order(reply: Message) -> tuple:
    """A fixed order of a round's replies (by examples, then loss; failures last, by reason), so that FedAvg's
    float32 sums do not depend on the order in which they arrived: the same clients give the same global model,
    bit for bit (and the same failure lines)."""
    if reply.has_error():
        return (1, 0, 0.0, _reason(reply))
    metrics = next(iter(reply.content.metric_records.values()), {})
    loss = metrics.get("train-loss", metrics.get("eval-loss", 0.0))
    return (0, int(metrics.get("num-examples", 0)), float(loss), reply.metadata.src_node_id)


class _ReportingFedAvg(FedAvg):
    """Flower's FedAvg, unchanged in what it samples and aggregates (the replies handed to it in a fixed order,
    :func:`_reply_order`); it also records each round for the summary (sampled clients, failed replies with
    their reasons, weighted losses, times) and keeps the aggregated arrays of the round."""

    def __init__(self, rounds: int, on_round: Callable[[RoundSummary, ArrayRecord | None], None], **kwargs) -> None:
        super().__init__(**kwargs)
        self.rounds = rounds
        self.on_round = on_round
        self.current = RoundSummary(0, rounds)
        self.arrays: ArrayRecord | None = None
        self.trained_rounds = 0

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.current = RoundSummary(server_round, self.rounds, started=time.perf_counter())
        self.arrays = None
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.current.sampled = len(messages)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = sorted(replies, key=_reply_order)
        s = self.current
        good = [r for r in replies if not r.has_error()]
        s.failures = [_reason(r) for r in replies if r.has_error()]
        s.failures += ["no reply within the round timeout"] * max(s.sampled - len(replies), 0)
        s.trained = len(good)
        s.train_seconds = sum(float(next(iter(r.content.metric_records.values())).get("seconds", 0.0)) for r in good)
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            self.arrays = arrays
            self.trained_rounds += 1
        if metrics is not None and "train-loss" in metrics:
            s.train_loss = float(metrics["train-loss"])
        return arrays, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        messages = list(super().configure_evaluate(server_round, arrays, config, grid))
        self.current.eval_sampled = len(messages)
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        replies = sorted(replies, key=_reply_order)
        s = self.current
        good = [r for r in replies if not r.has_error()]
        s.evaluated = len(good)
        s.eval_failures = [_reason(r) for r in replies if r.has_error()]
        s.eval_failures += ["no reply within the round timeout"] * max(s.eval_sampled - len(replies), 0)
        eval_seconds = sum(float(next(iter(r.content.metric_records.values())).get("seconds", 0.0)) for r in good)
        metrics = super().aggregate_evaluate(server_round, replies)
        if metrics is not None and "eval-loss" in metrics:
            s.eval_loss = float(metrics["eval-loss"])
            s.accuracy = float(metrics["accuracy"]) if "accuracy" in metrics else None
        s.client_seconds = s.train_seconds + eval_seconds
        s.seconds = time.perf_counter() - s.started
        self.on_round(s, self.arrays)
        return metrics


class _ProgressGrid:
    """The strategy's Grid with ``send_and_receive`` as Flower's grids do it (push, then pull until every reply
    is in or the timeout passes), pulling every ``poll`` seconds and reporting each reply to
    ``on_progress(phase, done, total)``. Everything else is the wrapped Grid's."""

    def __init__(self, grid: Grid, on_progress: Callable[[str, int, int], None] | None,
                 poll: float = POLL_SECONDS) -> None:
        self._grid = grid
        self._on_progress = on_progress
        self._poll = poll

    def __getattr__(self, name: str):
        return getattr(self._grid, name)

    def get_node_ids(self) -> Iterable[int]:
        # sorted: FedAvg samples positions of this list with Python's random (seeded), so the same nodes give the
        # same sample (a deployed SuperNode keeps its id; the Simulation Engine draws new ids every run)
        return sorted(self._grid.get_node_ids())

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        phase = messages[0].metadata.message_type if messages else ""
        ids = set(self._grid.push_messages(messages))
        total, replies = len(ids), []
        self._progress(phase, 0, total)
        end = time.monotonic() + (timeout if timeout is not None else 0.0)
        while ids and (timeout is None or time.monotonic() < end):
            got = list(self._grid.pull_messages(ids))
            if got:
                replies.extend(got)
                ids.difference_update(m.metadata.reply_to_message_id for m in got)
                self._progress(phase, total - len(ids), total)
            if ids:
                time.sleep(self._poll)
        return replies

    def _progress(self, phase: str, done: int, total: int) -> None:
        if self._on_progress is not None:
            self._on_progress(phase, done, total)


@dataclass
class FederatedResult:
    state: dict[str, np.ndarray]  # the global model after the last round
    rounds: list[RoundSummary]
    written: list[str]


def serve(grid: Grid, settings: ServerSettings, *, initial: Mapping[str, np.ndarray] | None = None,
          on_round: Callable[[RoundSummary], None] | None = None,
          on_progress: Callable[[str, int, int], None] | None = None, connect_timeout: float = 120.0,
          poll: float = POLL_SECONDS) -> FederatedResult:
    """Run the federation on ``grid``: wait for ``min_nodes`` nodes, then FedAvg's rounds from ``initial``
    (default: :func:`global_start` of the settings), then write the outputs. Raises FederatedError when no
    client trained in any round (nothing is written then). ``poll``: seconds between pulls of the replies."""
    settings.check()
    export_outputs = export_outputs_of(settings.artifacts) if settings.export else None
    if initial is None:
        params = read_partition(settings.params) if settings.params else None
        initial = global_start(settings.artifacts, params=params, params_source=settings.params,
                               checkpoint=settings.checkpoint or None, target=settings.target)
    if settings.seed is not None:
        random.seed(settings.seed)  # FedAvg samples with Python's random
    _wait_for_nodes(grid, settings.min_nodes, connect_timeout)
    summaries: list[RoundSummary] = []

    def finished(summary: RoundSummary, arrays: ArrayRecord | None) -> None:
        summaries.append(summary)
        if settings.save_rounds and arrays is not None:
            write_atomic(Path(settings.save_rounds) / f"round-{summary.round}.npz", npz_bytes(_state(arrays)))
        if on_round is not None:
            on_round(summary)

    strategy = _ReportingFedAvg(settings.rounds, finished, fraction_train=settings.fraction_train,
                                fraction_evaluate=settings.fraction_evaluate, min_train_nodes=1,
                                min_evaluate_nodes=1 if settings.fraction_evaluate else 0, min_available_nodes=1)
    result = strategy.start(grid=_ProgressGrid(grid, on_progress, poll), initial_arrays=_record(initial),
                            num_rounds=settings.rounds, timeout=settings.round_timeout,
                            train_config=ConfigRecord({"local-epochs": settings.local_epochs,
                                                       "lr": settings.learning_rate, "target": settings.target}),
                            evaluate_config=ConfigRecord({"target": settings.target}))
    if strategy.trained_rounds == 0:
        raise FederatedError(f"no client trained in any of the {settings.rounds} round(s); nothing written "
                             f"(the first failure: {_first_failure(summaries)})")
    state = _state(result.arrays)
    written = write_global(settings.artifacts, state, save=settings.save or None,
                           save_checkpoint=settings.save_checkpoint or None, export=settings.export or None,
                           export_outputs=export_outputs, target=settings.target)
    return FederatedResult(state, summaries, written)


def _first_failure(summaries: list[RoundSummary]) -> str:
    return next((f for s in summaries for f in s.failures), "none reported")


def _wait_for_nodes(grid: Grid, count: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while len(list(grid.get_node_ids())) < count:
        if time.monotonic() > end:
            raise FederatedError(f"{len(list(grid.get_node_ids()))} of {count} nodes connected after {timeout:g} s")
        time.sleep(POLL_SECONDS)


def make_serverapp(settings: ServerSettings, **kwargs) -> ServerApp:
    """A ServerApp running :func:`serve` with these settings (keyword arguments go to it); the result is left
    in ``app.result``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        app.result = serve(grid, settings, **kwargs)

    return app


# -- what `flwr run` starts in a deployment -------------------------------------------------------------------

clientapp = make_clientapp(client_side_from_context)
serverapp = ServerApp()


@serverapp.main()
def _deployed_main(grid: Grid, context: Context) -> None:
    """The deployed ServerApp: settings from the run config; each round's summary goes to Flower's log (``flwr
    run --stream``, ``flwr log``)."""
    try:
        settings = server_settings_from_config(context.run_config)
        result = serve(grid, settings, on_round=lambda s: [log(INFO, line) for line in s.lines()])
    except OplowerError as exc:
        log(INFO, "oplower federate: error: %s", " ".join(str(exc).split()))
        raise
    for path in result.written:
        log(INFO, "wrote %s", path)


__all__ = ["RUN_CONFIG", "ClientSide", "FederatedResult", "RoundSummary", "ServerSettings",
           "clientapp", "make_clientapp", "make_serverapp", "serve", "serverapp", "server_settings_from_config"]
