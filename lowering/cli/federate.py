"""``oplower federate``: federated training of an artifact directory in Flower's Simulation Engine.

Flower is an optional extra (``pip install 'oplower[federated]'``): this module imports without it, and the
command says so in one line when it is missing.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import numpy as np

from lowering.cli.arguments import positive_int
from lowering.cli.progress import Progress
from lowering.cli.run import load_npz
from lowering.modelio import write_atomic
from lowering.rules import TARGETS
from lowering.training.federated import FederatedError, require_flower

HELP = ("federated training on Flower: one client per data partition trains the artifact directory on plain "
        "onnxruntime, FedAvg aggregates, in Flower's Simulation Engine on this machine (needs oplower[federated])")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifacts", metavar="ARTIFACT_DIR",
                   help="directory with training_model.onnx, optimizer_model.onnx and eval_model.onnx")
    p.add_argument("--partition", action="append", default=[], metavar="P.npz",
                   help="one client's data, in --data's format of oplower train (repeatable: one client each)")
    p.add_argument("--split", metavar="DATA.npz",
                   help="instead of --partition: split this data file into --clients partitions (IID, or by label "
                        "with --dirichlet)")
    p.add_argument("--clients", type=positive_int, metavar="N", help="with --split: the number of clients")
    p.add_argument("--dirichlet", type=float, metavar="ALPHA",
                   help="with --split: split by label, each class's shares drawn from a Dirichlet distribution with "
                        "this concentration (small: non-IID); default IID")
    p.add_argument("--partition-dir", metavar="DIR",
                   help="with --split: write the partitions here (part-<k>.npz) and keep them (default: a temporary "
                        "directory)")
    p.add_argument("--rounds", type=int, required=True, metavar="R", help="federated rounds to run")
    p.add_argument("--local-epochs", type=int, default=1, metavar="E",
                   help="passes over its partition's batches a client trains each round (E*B steps; default 1)")
    p.add_argument("--lr", type=float, default=1e-3, metavar="LR", help="the clients' learning rate (default 1e-3)")
    p.add_argument("--fraction-train", type=float, default=1.0, metavar="F",
                   help="fraction of the clients FedAvg samples to train each round (default 1: all)")
    p.add_argument("--fraction-evaluate", type=float, default=1.0, metavar="F",
                   help="fraction of the clients that evaluate the new global model each round (default 1: all; 0: "
                        "no evaluation)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--params", metavar="P.npz",
                       help="the global model's start, by name (default: ARTIFACT_DIR/checkpoint, else the forward "
                            "model's initializers)")
    start.add_argument("--checkpoint", metavar="FILE", help="start from this onnxruntime-training checkpoint")
    p.add_argument("--save", metavar="OUT.npz", help="write the final global model here (the form --params reads)")
    p.add_argument("--save-checkpoint", metavar="OUT",
                   help="write the final global model as an onnxruntime-training checkpoint (no optimizer state)")
    p.add_argument("--export", metavar="OUT.onnx", help="write the final global model's inference model here")
    p.add_argument("--save-rounds", metavar="DIR", help="write the global model after each round here (round-<r>.npz)")
    p.add_argument("--threads", type=positive_int, default=1, metavar="N",
                   help="onnxruntime intra-op threads of each client (default 1)")
    p.add_argument("--cpus", type=positive_int, metavar="N",
                   help="CPUs of the Simulation Engine, one client at a time on each (default: every core)")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of FedAvg's client sampling and of --split (default 0)")
    p.add_argument("--target", choices=TARGETS, default="onnxruntime",
                   help="lowering target of the clients' models (default onnxruntime)")
    p.add_argument("--verbose", action="store_true", help="show Flower's and Ray's own log on stderr")


def run(args: argparse.Namespace) -> int:
    _check(args)
    require_flower(simulation=True)
    # Flower's modules only now that it is known to be there
    from lowering.training.federated.app import ServerSettings
    from lowering.training.federated.local import global_start, npz_bytes, read_partition, training_models
    from lowering.training.federated.partition import split
    from lowering.training.federated.simulation import federate

    settings = ServerSettings(args.artifacts, args.rounds, args.local_epochs, args.lr, args.fraction_train,
                              args.fraction_evaluate,
                              params=args.params or "", checkpoint=args.checkpoint or "", save=args.save or "",
                              save_checkpoint=args.save_checkpoint or "", export=args.export or "",
                              save_rounds=args.save_rounds or "", target=args.target, seed=args.seed)
    settings.check()
    params = read_partition(args.params) if args.params else None
    initial = global_start(args.artifacts, params=params, params_source=args.params or "",
                           checkpoint=args.checkpoint, target=args.target)
    with tempfile.TemporaryDirectory(prefix="oplower-federate-") as scratch:
        partitions = [Path(p) for p in args.partition]
        if args.split:
            models = training_models(args.artifacts, args.target)
            frozen = [n for n in initial if n not in models.params]
            parts = split(load_npz(Path(args.split)), models, args.clients, frozen=frozen, alpha=args.dirichlet,
                          seed=args.seed, source=args.split)
            folder = Path(args.partition_dir or scratch)
            folder.mkdir(parents=True, exist_ok=True)
            partitions = []
            for k, part in enumerate(parts):
                partitions.append(folder / f"part-{k}.npz")
                write_atomic(partitions[-1], npz_bytes(part))
            kind = "IID" if args.dirichlet is None else f"by label, Dirichlet alpha {args.dirichlet:g}"
            sizes = [int(np.prod(next(iter(part.values())).shape[:2])) for part in parts]
            print(f"split {args.split} into {len(parts)} partitions ({kind}): {', '.join(map(str, sizes))} samples"
                  + (f" in {args.partition_dir}" if args.partition_dir else ""))
        print(f"federating {len(partitions)} clients on {args.artifacts} for {args.rounds} round"
              f"{'s' if args.rounds > 1 else ''} in Flower's Simulation Engine ({args.local_epochs} local epoch"
              f"{'s' if args.local_epochs > 1 else ''}, lr {args.lr:g}, FedAvg over "
              + ("every client" if args.fraction_train == 1 else f"a fraction {args.fraction_train:g} of the clients")
              + " each round)", flush=True)
        progress = Progress(1)
        done = [0]

        def on_round(summary) -> None:
            done[0] = summary.round
            for line in summary.lines():
                progress.write(line)

        def on_progress(phase: str, finished: int, total: int) -> None:
            progress.total = max(total, 1)
            progress.update(finished, f"round {done[0] + 1}/{args.rounds} {phase} ({finished}/{total} clients)")

        try:
            result = federate(settings, partitions, threads=args.threads, cpus=args.cpus, initial=initial,
                              on_round=on_round, on_progress=on_progress, verbose=args.verbose)
        finally:
            progress.close()
    for path in result.written:
        print(f"wrote {path}")
    return 0


def _check(args: argparse.Namespace) -> None:
    """The one-line errors (exit 1) of arguments that cannot run, before Flower is even looked for."""
    if args.rounds < 1:
        raise FederatedError(f"--rounds {args.rounds}: the round count must be 1 or more")
    if args.local_epochs < 1:
        raise FederatedError(f"--local-epochs {args.local_epochs}: must be 1 or more")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise FederatedError(f"--lr {args.lr}: the learning rate must be finite and > 0")
    if not (0 < args.fraction_train <= 1):
        raise FederatedError(f"--fraction-train {args.fraction_train}: must be in (0, 1]")
    if not (0 <= args.fraction_evaluate <= 1):
        raise FederatedError(f"--fraction-evaluate {args.fraction_evaluate}: must be in [0, 1]")
    if args.split and args.partition:
        raise FederatedError("--split and --partition: give the clients' data one way")
    if args.split and not args.clients:
        raise FederatedError("--split: also give --clients N")
    if not args.split and (args.clients or args.dirichlet is not None or args.partition_dir):
        raise FederatedError("--clients, --dirichlet and --partition-dir go with --split DATA.npz")
    if not args.split and not args.partition:
        raise FederatedError("no partitions: give each client's data with --partition P.npz (once per client) or "
                             "--split DATA.npz --clients N")
    if not Path(args.artifacts).is_dir():
        raise FederatedError(f"{args.artifacts}: not an artifact directory (expected training_model.onnx, "
                             "optimizer_model.onnx and eval_model.onnx)")
