"""onnxruntime-training's own train step, for the speed comparison (run with the venv of make_env.sh).

    /work/ortt-venv/bin/python tools/ort_training/native_step.py make resnet_cifar --batch 32 --out DIR
    /work/ortt-venv/bin/python tools/ort_training/native_step.py time DIR --steps 30 [--threads 2] [--spin]

    /work/ortt-venv/bin/python tools/ort_training/native_step.py memory DIR [--steps 5]
    /work/ortt-venv/bin/python tools/ort_training/native_step.py bench --out native.json [--artifact DIR]
        [--batches 4 64 256] [--threads 1 2] [--steps 20]

``make`` writes a generate_artifacts directory for a benchmark network (not a committed fixture: these are
megabytes) plus ``data.npz`` (``input``, ``labels``), ``initial_params.npz`` and ``meta.json`` as the
committed artifacts have them, so ``oplower train`` and ``tools/ab_train_step.py`` read it alike.
``time`` loads DIR's checkpoint into ``Module`` + ``Optimizer`` and prints one JSON line: the median
milliseconds of ``module(input, labels); optimizer.step(); module.lazy_reset_grad()`` over ``--steps``
steps after warm-up steps, with 2 intra-op threads and spinning off unless ``--spin`` (onnxruntime's default
spins, which on 2 cores takes them from whatever runs next).
``bench`` times the native step of an artifact (default: the committed ``cnn``) at each batch and thread count
that ``oplower bench --training`` runs, and writes the JSON that the bench's ``--ort-training-json`` reads
(its onnxruntime-training column). A batch other than the artifact's own runs on a copy whose data inputs and
activations are re-declared, as the bench's ``with_batch`` does, with seeded random data.
``memory`` prints the resident memory before the first step and the peak during the steps (for
``tools/step_memory.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

WARMUP = 10
HERE = Path(__file__).resolve().parent
CNN = HERE.parents[1] / "tests" / "fixtures" / "ort_training" / "artifacts" / "cnn"
BUFFER_SUFFIX, LAZY_RESET = "_grad.accumulation.buffer", "lazy_reset_grad"


def resnet_cifar():
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.short = None if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
            self.relu = nn.ReLU()

        def forward(self, x):
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return self.relu(y + (x if self.short is None else self.short(x)))

    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.MaxPool2d(3, stride=1, padding=1),
                         Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


NETWORKS = {"resnet_cifar": (resnet_cifar, (3, 32, 32), 10)}


def make(name: str, batch: int, out: Path) -> None:
    import onnx
    import torch
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_artifacts import randomize_batch_norm

    factory, shape, classes = NETWORKS[name]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = factory()
    randomize_batch_norm(model, gen)
    model.train()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    x = torch.randn(batch, *shape, generator=gen)
    forward = out / "forward.onnx"
    torch.onnx.export(model, (x,), str(forward), input_names=["input"], output_names=["output"], opset_version=17,
                      do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING, dynamo=False)
    fwd = onnx.load(forward)
    trainable = [i.name for i in fwd.graph.initializer if i.name.endswith(("weight", "bias"))]
    frozen = [i.name for i in fwd.graph.initializer if i.name not in trainable]
    artifacts.generate_artifacts(fwd, requires_grad=trainable, frozen_params=frozen,
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=str(out))
    forward.unlink()
    labels = np.random.default_rng(0).integers(0, classes, size=batch).astype(np.int64)
    np.savez(out / "data.npz", input=x.numpy(), labels=labels)
    state = CheckpointState.load_checkpoint(str(out / "checkpoint"))
    np.savez(out / "initial_params.npz", **{p: np.array(state.parameters[p].data) for p in trainable + frozen})
    (out / "meta.json").write_text(json.dumps({"name": name, "labels_input": "labels", "learning_rate": 1e-3,
                                               "batch": batch, "trainable_params": trainable,
                                               "frozen_params": frozen, "optimizer": "AdamW"}, indent=1) + "\n")
    print(f"wrote {out}")


def at_batch(directory: Path, batch: int, workdir: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """``directory`` and its data at its own batch; otherwise a copy in ``workdir`` whose training model has its
    data inputs' and activations' leading dim re-declared (parameter gradients excluded), and seeded data."""
    import onnx

    data = dict(np.load(directory / "data.npz"))
    if data["input"].shape[0] == batch:
        return directory, data
    model = onnx.load(directory / "training_model.onnx")
    params = set(np.load(directory / "initial_params.npz").files)
    graph = model.graph
    inputs = [i for i in graph.input if i.name not in params and not i.name.endswith(BUFFER_SUFFIX)
              and i.name != LAZY_RESET]
    old = inputs[0].type.tensor_type.shape.dim[0].dim_value
    for value in (*inputs, *graph.value_info):
        dims = value.type.tensor_type.shape.dim
        if len(dims) and dims[0].dim_value == old and not any(value.name.startswith(p + "_grad") for p in params):
            dims[0].dim_value = batch
    target = workdir / f"batch{batch}"
    if not target.exists():
        shutil.copytree(directory, target, ignore=shutil.ignore_patterns("training_model.onnx"))
        onnx.save(model, target / "training_model.onnx")
    rng = np.random.default_rng(batch)
    classes = int(data["labels"].max()) + 1
    return target, {"input": rng.standard_normal((batch, *data["input"].shape[1:]), dtype=np.float32),
                    "labels": rng.integers(0, classes, batch).astype(data["labels"].dtype)}


def bench(directory: Path, batches: list[int], threads: list[int], steps: int) -> dict:
    import tempfile

    import onnxruntime

    rows = []
    with tempfile.TemporaryDirectory() as work:
        for count in threads:
            for batch in batches:
                source, data = at_batch(directory, batch, Path(work))
                row = time_native(source, steps, count, False, data)
                rows.append({"batch": batch, "threads": count, **row})
                print(f"{directory.name} batch {batch}, {count} thread(s): {row['median_ms']:.3f} ms", file=sys.stderr)
    return {"tool": "tools/ort_training/native_step.py bench", "onnxruntime_training": onnxruntime.__version__,
            "artifact": directory.name, "steps": rows}


def time_native(directory: Path, steps: int, threads: int, spin: bool, data: dict | None = None) -> dict:
    import onnxruntime as ort
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    state = CheckpointState.load_checkpoint(str(directory / "checkpoint"))
    module = Module(str(directory / "training_model.onnx"), state, device="cpu", session_options=options)
    optimizer = Optimizer(str(directory / "optimizer_model.onnx"), module)
    data = data if data is not None else np.load(directory / "data.npz")
    x, y = data["input"], data["labels"]
    module.train()

    def step() -> None:
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()

    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"median_ms": float(np.median(times) * 1e3), "steps": steps, "threads": threads, "spin": spin}


def memory_now() -> dict:
    """VmRSS and VmHWM (the peak since the last reset) of this process, MB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: 5 > /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def memory_native(directory: Path, steps: int, threads: int) -> dict:
    """Peak resident memory of ``steps`` native steps: RSS before the first step, the peak during the steps
    (VmHWM reset just before them), MB. ``tools/step_memory.py`` runs this in a fresh process."""
    import gc

    import onnxruntime as ort
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    state = CheckpointState.load_checkpoint(str(directory / "checkpoint"))
    module = Module(str(directory / "training_model.onnx"), state, device="cpu", session_options=options)
    optimizer = Optimizer(str(directory / "optimizer_model.onnx"), module)
    data = np.load(directory / "data.npz")
    x, y = data["input"], data["labels"]
    module.train()
    gc.collect()
    before = memory_now()["VmRSS"]
    reset_peak()
    for _ in range(steps):
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
    return {"side": "onnxruntime-training", "rss_before_mb": before, "peak_mb": memory_now()["VmHWM"],
            "steps": steps, "threads": threads}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("network", choices=sorted(NETWORKS))
    m.add_argument("--batch", type=int, default=32)
    m.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("time")
    t.add_argument("directory", type=Path)
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--spin", action="store_true")
    c = sub.add_parser("bench")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--artifact", type=Path, default=CNN)
    c.add_argument("--batches", type=int, nargs="+", default=[4, 64, 256])
    c.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    c.add_argument("--steps", type=int, default=20)
    mem = sub.add_parser("memory")
    mem.add_argument("directory", type=Path)
    mem.add_argument("--steps", type=int, default=5)
    mem.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.command == "memory":
        print(json.dumps(memory_native(args.directory, args.steps, args.threads)))
    elif args.command == "make":
        make(args.network, args.batch, args.out)
    elif args.command == "bench":
        result = bench(args.artifact, args.batches, args.threads, args.steps)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    else:
        print(json.dumps(time_native(args.directory, args.steps, args.threads, args.spin)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
