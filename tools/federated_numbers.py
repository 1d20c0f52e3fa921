"""The numbers and the picture of federated training on Flower (docs/performance.md, docs/federated.md).

    PYTHONPATH=. python tools/federated_numbers.py speed [--rounds 10] [--clients 10] [--batches 4] [--epochs 1 10]
    PYTHONPATH=. python tools/federated_numbers.py curve [--rounds 20] [--svg docs/federated_curve.svg]

``speed``: 10 simulated clients on the committed cnn artifact in Flower's Simulation Engine (every core, one
onnxruntime thread per client), each with ``--batches`` batches of 4 learnable samples; per round the wall
time, the clients' own time in their train and evaluate handlers (summed), and the same work done without
Flower (every client's ``train_local`` + ``evaluate_local`` in a loop in this process, models already
lowered). Rounds per minute in the steady state (rounds 2..R) and end to end (Ray's start and stop included).

``curve``: the same data split IID and by label (Dirichlet alpha 1 and 0.1) over the clients; the global model of
every round evaluated on a held-out set (the same for both), written as an SVG (a dependency-free writer).

Never imported by oplower or its tests; needs the extra (``pip install 'oplower[federated]'``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lowering.training.federated.app import ServerSettings  # noqa: E402
from lowering.training.federated.local import evaluate_local, global_start, train_local, training_models  # noqa: E402
from lowering.training.federated.partition import split  # noqa: E402
from lowering.training.federated.simulation import federate  # noqa: E402
from lowering.training.workflow import evaluate  # noqa: E402

CNN = ROOT / "tests" / "fixtures" / "ort_training" / "artifacts" / "cnn"


def samples(rng: np.random.Generator, batches: int, noise: float = 1.0) -> dict[str, np.ndarray]:
    """Learnable data for the cnn (as tests/test_federated.py): class c = a fixed pattern of class c + noise."""
    patterns = np.random.default_rng(7).normal(size=(4, 3, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 4, size=(batches, 4))
    images = patterns[labels] + noise * rng.normal(size=(batches, 4, 3, 8, 8)).astype(np.float32)
    return {"input": images.astype(np.float32), "labels": labels.astype(np.int64)}


def write_partitions(folder: Path, parts: list[dict]) -> list[Path]:
    paths = []
    for k, part in enumerate(parts):
        paths.append(folder / f"part-{k}.npz")
        np.savez(paths[-1], **part)
    return paths


def speed(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_partitions(Path(tmp), [samples(rng, args.batches) for _ in range(args.clients)])
        state = global_start(CNN)
        for epochs in args.epochs:
            # the clients' work without Flower, in this process (models lowered once, as in a warm actor)
            train_local(CNN, state, paths[0], epochs=epochs, learning_rate=0.01, threads=1)
            began = time.perf_counter()
            for p in paths:
                trained = train_local(CNN, state, p, epochs=epochs, learning_rate=0.01, threads=1)
                evaluate_local(CNN, trained.state, p, threads=1)
            plain = time.perf_counter() - began
            rounds = []
            began = time.perf_counter()
            federate(ServerSettings(str(CNN), args.rounds, epochs, 0.01), paths, threads=1, on_round=rounds.append)
            total = time.perf_counter() - began
            steady = rounds[1:]
            wall = statistics.median(r.seconds for r in steady)
            clients = statistics.median(r.client_seconds for r in steady)
            overhead = wall - clients / cpus
            print(f"{args.clients} clients x {args.batches} batches, {epochs} local epoch(s) ({epochs * args.batches} "
                  f"steps each), {args.rounds} rounds, {cpus} CPUs:")
            print(f"  round 1 (Ray actors start, lower the artifacts): {rounds[0].seconds:.2f} s")
            print(f"  rounds 2..{args.rounds}: median {wall * 1000:.0f} ms a round = {60 / wall:.0f} rounds/min; "
                  f"clients' handlers {clients * 1000:.0f} ms summed ({clients / cpus * 1000:.0f} ms on {cpus} CPUs); "
                  f"the same work without Flower {plain * 1000:.0f} ms in one process")
            print(f"  Flower's overhead per round: {overhead * 1000:.0f} ms (wall - clients' time / CPUs), "
                  f"{wall / (clients / cpus):.1f}x the clients' own time")
            print(f"  end to end (Ray's start and stop included): {total:.1f} s = {60 * args.rounds / total:.1f} "
                  "rounds/min")


def curve(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(1)
    data = samples(rng, args.clients * args.batches, noise=args.noise)
    held_out = samples(np.random.default_rng(2), 16, noise=args.noise)
    models = training_models(CNN)
    state = global_start(CNN)
    frozen = [n for n in state if n not in models.params]
    lines = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, alpha in (("IID", None), *((f"by label, Dirichlet alpha {a:g}", a) for a in args.alpha)):
            folder = Path(tmp) / f"run-{len(lines)}"
            (folder / "rounds").mkdir(parents=True)
            paths = write_partitions(folder, split(data, models, args.clients, frozen=frozen, alpha=alpha, seed=0))
            summaries = []
            federate(ServerSettings(str(CNN), args.rounds, args.epochs, args.lr, save_rounds=str(folder / "rounds")),
                     paths, threads=1, on_round=summaries.append)
            losses = [evaluate(CNN, held_out, state).loss]
            for r in range(1, args.rounds + 1):
                losses.append(evaluate(CNN, held_out, dict(np.load(folder / "rounds" / f"round-{r}.npz"))).loss)
            lines[label] = losses
            print(label, " ".join(f"{v:.4f}" for v in losses))
            print("  federated eval loss (clients' own partitions):",
                  " ".join(f"{s.eval_loss:.4f}" for s in summaries))
    svg = line_chart(lines, title=f"Global model's eval loss on a held-out set: {args.clients} clients, cnn artifact, "
                                  f"{args.epochs} local epoch(s), lr {args.lr:g}",
                     xlabel="round", ylabel="eval loss")
    Path(args.svg).write_text(svg, encoding="utf-8")
    print(f"wrote {args.svg}")


def line_chart(series: dict[str, list[float]], *, title: str, xlabel: str, ylabel: str, width: int = 640,
               height: int = 360) -> str:
    """A line chart as SVG text: one polyline per series (x = index), axes with ticks, a legend."""
    left, right, top, bottom = 60, 20, 40, 50
    n = max(len(v) for v in series.values())
    lo = min(min(v) for v in series.values())
    hi = max(max(v) for v in series.values())
    lo, hi = np.floor(lo * 10) / 10, np.ceil(hi * 10) / 10
    sx = (width - left - right) / max(n - 1, 1)
    sy = (height - top - bottom) / (hi - lo or 1)

    def x(i: float) -> float:
        return left + i * sx

    def y(v: float) -> float:
        return height - bottom - (v - lo) * sy

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="13">{title}</text>',
           f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>']
    step = max(1, (n - 1) // 10)
    for i in range(0, n, step):
        out.append(f'<line x1="{x(i):.1f}" y1="{height - bottom}" x2="{x(i):.1f}" y2="{height - bottom + 5}" '
                   'stroke="black"/>')
        out.append(f'<text x="{x(i):.1f}" y="{height - bottom + 18}" text-anchor="middle">{i}</text>')
    ticks = np.linspace(lo, hi, 6)
    for v in ticks:
        out.append(f'<line x1="{left - 5}" y1="{y(v):.1f}" x2="{width - right}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 8}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">{xlabel}</text>')
    out.append(f'<text x="15" y="{(top + height - bottom) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 15 {(top + height - bottom) / 2})">{ylabel}</text>')
    for k, (label, values) in enumerate(series.items()):
        color = colors[k % len(colors)]
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{points}"/>')
        ly = top + 10 + 18 * k
        out.append(f'<line x1="{width - right - 230}" y1="{ly}" x2="{width - right - 205}" y2="{ly}" '
                   f'stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{width - right - 200}" y="{ly + 4}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--rounds", type=int, default=10)
    s.add_argument("--clients", type=int, default=10)
    s.add_argument("--batches", type=int, default=4)
    s.add_argument("--epochs", type=int, nargs="+", default=[1, 10])
    c = sub.add_parser("curve")
    c.add_argument("--rounds", type=int, default=20)
    c.add_argument("--clients", type=int, default=10)
    c.add_argument("--batches", type=int, default=4)
    c.add_argument("--epochs", type=int, default=1)
    c.add_argument("--lr", type=float, default=0.01)
    c.add_argument("--alpha", type=float, nargs="+", default=[1.0, 0.1])
    c.add_argument("--noise", type=float, default=2.0)
    c.add_argument("--svg", default=str(ROOT / "docs" / "federated_curve.svg"))
    args = parser.parse_args()
    speed(args) if args.what == "speed" else curve(args)


if __name__ == "__main__":
    main()
