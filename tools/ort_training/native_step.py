"""onnxruntime-training's own train step, for the speed comparison (run with the venv of make_env.sh).

    /work/ortt-venv/bin/python tools/ort_training/native_step.py make resnet_cifar --batch 32 --out DIR
    /work/ortt-venv/bin/python tools/ort_training/native_step.py time DIR --steps 30 [--threads 2] [--spin]

    /work/ortt-venv/bin/python tools/ort_training/native_step.py memory DIR [--steps 5]
    /work/ortt-venv/bin/python tools/ort_training/native_step.py profile DIR [--steps 20]
    /work/ortt-venv/bin/python tools/ort_training/native_step.py torch DIR [--steps 30]
    /work/ortt-venv/bin/python tools/ort_training/native_step.py generate DIR [--runs 5] [--once]
    /work/ortt-venv/bin/python tools/ort_training/native_step.py bench --out native.json [--artifact DIR]
        [--batches 4 64 256] [--threads 1 2] [--steps 20]

``make`` writes a generate_artifacts directory for a benchmark network (not a committed fixture: these are
megabytes) plus ``data.npz`` (``input``, ``labels``), ``initial_params.npz`` and ``meta.json`` as the
committed artifacts have them, so ``oplower train`` and ``tools/ab_train_step.py`` read it alike, and
``forward_model.onnx``, torch's export before ``patch_forward`` (oplower's generator input).
``generate`` times onnxruntime-training's ``generate_artifacts`` on DIR's forward model: ``--runs`` fresh
processes, each timing the call alone (imports and loading excluded), printing each run and the median;
``--once``: one run in this process (``tools/ab_artifacts.py`` alternates these with oplower's).
``time`` loads DIR's checkpoint into ``Module`` + ``Optimizer`` and prints one JSON line: the median
milliseconds of ``module(input, labels); optimizer.step(); module.lazy_reset_grad()`` over ``--steps``
steps after warm-up steps, with 2 intra-op threads and spinning off unless ``--spin`` (onnxruntime's default
spins, which on 2 cores takes them from whatever runs next).
``bench`` times the native step of an artifact (default: the committed ``cnn``) at each batch and thread count
that ``oplower bench --training`` runs, and the other committed artifacts the bench times at their own batch,
and counts each one's kernels per step by op type (a profiled run apart); it writes the JSON that the bench's
``--ort-training-json`` reads (its onnxruntime-training columns). A batch other than the artifact's own runs
on a copy whose data inputs and activations are re-declared, as the bench's ``with_batch`` does, with seeded
random data.
``memory`` prints the resident memory before the first step and the peak during the steps (for
``tools/step_memory.py``); ``profile`` the kernel time per step by op type, from onnxruntime's profiler (for
``tools/step_profile.py``); ``torch`` times torch's eager step of the same network, weights and batch (the
venv has torch; ``tools/ab_train_step.py --torch``). ``make`` knows ``resnet_cifar``, ``mobilenet_v2_cifar``
(width 0.5, 32x32) and ``bert_mini`` (2 blocks, hidden 128, sequence 64): networks of the sizes people train,
where the kernels do the work, unlike the tiny committed fixtures where per-kernel overhead decides.
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
# the committed artifacts ``oplower bench --training`` times beside the cnn (lowering/bench/training.py's list)
ARCHITECTURES = ("bert", "bert_torch", "gpt", "vit", "mobilenet", "mlp_act", "lstm")


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


def mobilenet_v2_cifar():
    """MobileNetV2 at width 0.5 for 32x32 inputs (torchvision's block table, first conv at stride 1, the
    stride-2 stages from 24 channels on): 17 inverted residuals, 52 Conv + BatchNorm pairs, ReLU6, Dropout."""
    from torch import nn

    def conv_bn(cin: int, cout: int, kernel: int, stride: int, groups: int = 1, act: bool = True):
        layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        return layers + [nn.ReLU6()] if act else layers

    class Inverted(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int):
            super().__init__()
            mid = cin * expand
            layers = (conv_bn(cin, mid, 1, 1) if expand != 1 else []) + conv_bn(mid, mid, 3, stride, mid)
            self.layers = nn.Sequential(*layers, *conv_bn(mid, cout, 1, 1, act=False))
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.layers(x) if self.residual else self.layers(x)

    table = [(1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
    layers, cin = conv_bn(3, 16, 3, 1), 16
    for expand, channels, repeats, stride in table:
        cout = max(8, channels // 2)
        for i in range(repeats):
            layers.append(Inverted(cin, cout, stride if i == 0 else 1, expand))
            cin = cout
    layers += [*conv_bn(cin, 640, 1, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(640, 10)]
    return nn.Sequential(*layers)


BERT_MINI = {"vocab": 2048, "seq": 64, "hidden": 128, "heads": 2, "ffn": 512, "layers": 2}


def bert_mini():
    """A BERT-mini-sized encoder (2 post-norm blocks, hidden 128, 2 heads, FFN 512, erf GELU, sequence 64):
    token + position embeddings, hand-written attention as HF BERT exports it, a classifier on the first token."""
    import torch
    from torch import nn

    v, t, h, heads, ffn, depth = (BERT_MINI[k] for k in ("vocab", "seq", "hidden", "heads", "ffn", "layers"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.out = (nn.Linear(h, h) for _ in range(4))
            self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.mlp = nn.Sequential(nn.Linear(h, ffn), nn.GELU(), nn.Linear(ffn, h))
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            b, n, _ = x.shape
            d = h // heads

            def split(y):
                return y.reshape(b, n, heads, d).transpose(1, 2)

            q, k, val = split(self.q(x)), split(self.k(x)), split(self.v(x))
            attn = self.drop(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / d ** 0.5, dim=-1))
            x = self.norm1(x + self.drop(self.out(torch.matmul(attn, val).transpose(1, 2).reshape(b, n, h))))
            return self.norm2(x + self.drop(self.mlp(x)))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(v, h), nn.Embedding(t, h)
            self.norm = nn.LayerNorm(h)
            self.blocks = nn.Sequential(*(Block() for _ in range(depth)))
            self.head = nn.Linear(h, 10)

        def forward(self, tokens):
            x = self.norm(self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]).unsqueeze(0)))
            return self.head(self.blocks(x)[:, 0])

    return Bert()


# name: (factory, per-sample input shape, classes, vocabulary for token inputs or None)
NETWORKS = {"resnet_cifar": (resnet_cifar, (3, 32, 32), 10, None),
            "mobilenet_v2_cifar": (mobilenet_v2_cifar, (3, 32, 32), 10, None),
            "bert_mini": (bert_mini, (BERT_MINI["seq"],), 10, BERT_MINI["vocab"])}


def make(name: str, batch: int, out: Path) -> None:
    import onnx
    import torch
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_artifacts import patch_forward, perturb_constant_parameters, randomize_batch_norm, zero_dropout_ratios

    factory, shape, classes, vocab = NETWORKS[name]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = factory()
    randomize_batch_norm(model, gen)
    perturb_constant_parameters(model, gen)  # no two equal initializers (onnxruntime would merge them)
    model.train()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    x = torch.randint(0, vocab, (batch, *shape), generator=gen) if vocab else torch.randn(batch, *shape, generator=gen)
    forward = out / "forward_model.onnx"  # kept, unpatched: oplower's generator input (tools/ab_artifacts.py)
    torch.onnx.export(model, (x,), str(forward), input_names=["input"], output_names=["output"], opset_version=17,
                      do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING, dynamo=False)
    fwd = patch_forward(onnx.load(forward))  # LayerNormalization's Mean/InvStdDev, Dropout masks
    named = {n for n, _ in model.named_parameters()}
    trainable = [i.name for i in fwd.graph.initializer if i.name in named]
    frozen = [i.name for i in fwd.graph.initializer if i.name not in trainable]
    artifacts.generate_artifacts(fwd, requires_grad=trainable, frozen_params=frozen,
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=str(out))
    for f in ("training_model.onnx", "eval_model.onnx"):  # comparable runs: no random masks on either side
        zero_dropout_ratios(out / f)
    labels = np.random.default_rng(0).integers(0, classes, size=batch).astype(np.int64)
    np.savez(out / "data.npz", input=x.numpy(), labels=labels)
    state = CheckpointState.load_checkpoint(str(out / "checkpoint"))
    np.savez(out / "initial_params.npz", **{p: np.array(state.parameters[p].data) for p in trainable + frozen})
    (out / "meta.json").write_text(json.dumps({"name": name, "labels_input": "labels", "learning_rate": 1e-3,
                                               "batch": batch, "trainable_params": trainable,
                                               "frozen_params": frozen, "loss": "CrossEntropyLoss",
                                               "optimizer": "AdamW"}, indent=1) + "\n")
    print(f"wrote {out}")


def time_generate(directory: Path) -> dict:
    """One timed ``generate_artifacts`` of DIR's ``forward_model.onnx`` (``make`` keeps it) in this process, with
    meta.json's parameters, CrossEntropyLoss and AdamW, into a temporary directory. Timed: the call alone (it
    writes the four files); not timed: the imports (``onnxruntime.training`` imports torch), loading the forward
    model and ``patch_forward`` (the by-hand fixes generate_artifacts needs). A fresh process per run
    (``--runs``): the first call in a process is what a user's script pays; ``second_ms`` times a second call
    in the same process."""
    import tempfile

    start = time.perf_counter()
    import onnx
    from onnxruntime.training import artifacts

    sys.path.insert(0, str(HERE))
    from make_artifacts import patch_forward

    imported = time.perf_counter() - start
    meta = json.loads((directory / "meta.json").read_text())
    fwd = patch_forward(onnx.load(directory / "forward_model.onnx"))
    times = []
    for _ in range(2):  # the first call (what a script pays) and a second one in the same process
        with tempfile.TemporaryDirectory() as work:
            start = time.perf_counter()
            artifacts.generate_artifacts(fwd, requires_grad=meta["trainable_params"],
                                         frozen_params=meta["frozen_params"], loss=artifacts.LossType.CrossEntropyLoss,
                                         optimizer=artifacts.OptimType.AdamW, artifact_directory=work)
            times.append((time.perf_counter() - start) * 1e3)
            sizes = {f.name: f.stat().st_size for f in Path(work).iterdir()}
    return {"side": "onnxruntime-training", "ms": times[0], "second_ms": times[1], "import_ms": imported * 1e3,
            "files": sizes}


def generate_runs(directory: Path, runs: int) -> dict:
    """``runs`` fresh processes of ``generate --once``: each run's milliseconds and their median."""
    import subprocess

    times = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, __file__, "generate", str(directory), "--once"], capture_output=True,
                             text=True, check=True)
        times.append(json.loads(out.stdout.strip().splitlines()[-1])["ms"])
    return {"side": "onnxruntime-training", "runs_ms": times, "median_ms": float(np.median(times))}


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


def bench(directory: Path, batches: list[int], threads: list[int], steps: int,
          architectures: list[str] | None = None) -> dict:
    """The step's median ms at each batch and thread count, and its kernels per step ({op type: [kernel ms,
    kernels]} of the training session, onnxruntime's profiler, in a run of its own; the optimizer session is one
    kernel per node of the optimizer model); ``architectures``: the committed artifacts beside ``directory``,
    each at its own batch, alike."""
    import tempfile

    import onnxruntime

    def kernels(source: Path, data: dict | None, count: int) -> dict:
        profiled = profile_native(source, steps, count, data)
        return {"kernels": profiled["training"], "optimizer_kernels": optimizer_kernels(source)}

    rows, others = [], []
    with tempfile.TemporaryDirectory() as work:
        for count in threads:
            for batch in batches:
                source, data = at_batch(directory, batch, Path(work))
                row = time_native(source, steps, count, False, data)
                rows.append({"batch": batch, "threads": count, **row, **kernels(source, data, count)})
                print(f"{directory.name} batch {batch}, {count} thread(s): {row['median_ms']:.3f} ms", file=sys.stderr)
    for name in architectures or []:
        source = directory.parent / name
        for count in threads:
            row = time_native(source, steps, count, False)
            others.append({"artifact": name, "threads": count, **row, **kernels(source, None, count)})
            print(f"{name}, {count} thread(s): {row['median_ms']:.3f} ms", file=sys.stderr)
    return {"tool": "tools/ort_training/native_step.py bench", "onnxruntime_training": onnxruntime.__version__,
            "artifact": directory.name, "steps": rows, "architectures": others}


def optimizer_kernels(directory: Path) -> int:
    """Kernels per optimizer step: one per node of the optimizer model (one AdamWOptimizer over every parameter)."""
    import onnx

    return len(onnx.load(directory / "optimizer_model.onnx", load_external_data=False).graph.node)


def labels_of(directory: Path, data) -> np.ndarray:
    """The labels array of ``data``: under "labels", or under the artifact's labels input name (meta.json)."""
    if "labels" in data:
        return data["labels"]
    return data[json.loads((directory / "meta.json").read_text())["labels_input"]]


def time_native(directory: Path, steps: int, threads: int, spin: bool, data: dict | None = None,
                clock: str = "wall") -> dict:
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
    x, y = data["input"], labels_of(directory, data)
    module.train()

    def step() -> None:
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()

    for _ in range(WARMUP):
        step()
    timer = time.perf_counter if clock == "wall" else time.process_time
    return {"median_ms": median_ms(step, steps, timer), "steps": steps, "threads": threads, "spin": spin,
            "clock": clock}


def median_ms(step, steps: int, clock=time.perf_counter) -> float:
    """The median milliseconds of ``steps`` calls of ``step`` (warmed up by the caller), by ``clock`` (the wall
    clock, or ``time.process_time``: the CPU time of all the process's threads)."""
    times = []
    for _ in range(steps):
        start = clock()
        step()
        times.append(clock() - start)
    return float(np.median(times) * 1e3)


def profile_native(directory: Path, steps: int, threads: int, data: dict | None = None) -> dict:
    """Kernel milliseconds and kernels per step by op type of the training session (onnxruntime's profiler),
    {op: [ms, count]}, and the optimizer step's wall-clock median, for ``tools/step_profile.py``."""
    import tempfile

    import onnxruntime as ort
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    with tempfile.TemporaryDirectory() as work:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(work) / "native")
        state = CheckpointState.load_checkpoint(str(directory / "checkpoint"))
        module = Module(str(directory / "training_model.onnx"), state, device="cpu", session_options=options)
        optimizer = Optimizer(str(directory / "optimizer_model.onnx"), module)
        data = data if data is not None else np.load(directory / "data.npz")
        x, y = data["input"], labels_of(directory, data)
        module.train()
        optimizer_ms = []
        for k in range(WARMUP + steps):
            module(x, y)
            start = time.perf_counter()
            optimizer.step()  # its session is not profiled (Optimizer takes no options): timed by the clock
            if k >= WARMUP:
                optimizer_ms.append((time.perf_counter() - start) * 1e3)
            module.lazy_reset_grad()
        del optimizer, module  # each session writes its profile when it is destroyed
        import gc

        gc.collect()
        files = sorted(Path(work).glob("native*.json"))
        sessions: list[dict] = []
        for path in files:
            events = json.loads(path.read_text())
            runs = [e for e in events if e.get("name") == "model_run"]
            if not runs:
                continue
            first = runs[WARMUP]["ts"] if len(runs) > WARMUP else runs[0]["ts"]
            counted = len([r for r in runs if r["ts"] >= first])
            ops: dict[str, list[float]] = {}
            for e in events:
                if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first:
                    entry = ops.setdefault(e["args"]["op_name"], [0.0, 0])
                    entry[0] += e["dur"] / 1e3 / counted
                    entry[1] += 1 / counted
            sessions.append(ops)
    training = max(sessions, key=lambda ops: sum(v[1] for v in ops.values()), default={})
    return {"training": training, "optimizer_wall_ms": float(np.median(optimizer_ms)), "steps": steps,
            "threads": threads}


def time_torch(directory: Path, steps: int, threads: int) -> dict:
    """torch's eager train step of a ``make`` network (meta.json's name) from DIR's initial parameters: the
    same weights and batch, CrossEntropyLoss, torch.optim.AdamW with the optimizer model's hyperparameters
    (adam_mode aside, which moves epsilon only); forward, backward, ``step()``, ``zero_grad()``. The median
    milliseconds after warm-up, and the first loss (which must equal the other sides')."""
    # torch as users run it: OpenMP's default (workers spin between ops). Alone on the cores that is its fastest
    # (resnet_cifar b32: 47 ms against 48-58 passive); next to another busy process spinning made it up to 15x
    # slower (bert_mini 1,478 against 88 ms passive), so measure on a quiet machine
    import onnx
    import torch

    meta = json.loads((directory / "meta.json").read_text())
    if meta.get("name") not in NETWORKS:
        raise SystemExit(f"{directory}: torch's step needs a network of `make` ({', '.join(NETWORKS)})")
    torch.set_num_threads(threads)
    factory, _, _, vocab = NETWORKS[meta["name"]]
    model = factory()
    initial = dict(np.load(directory / "initial_params.npz"))
    state = {k for k in model.state_dict() if not k.endswith("num_batches_tracked")}
    if state != set(initial):
        raise SystemExit(f"{directory}: the network's state does not match initial_params.npz: "
                         f"{sorted(state ^ set(initial))[:3]}")
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in initial.items()}, strict=False)
    model.train()
    for module in model.modules():  # the artifacts' Dropout ratios are zeroed after generation (make)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    node = next(n for n in onnx.load(directory / "optimizer_model.onnx").graph.node if n.op_type == "AdamWOptimizer")
    a = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-8, "weight_decay": 0.0}  # the op's defaults
    a.update({attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute})
    optimizer = torch.optim.AdamW(model.parameters(), lr=meta["learning_rate"], betas=(a["alpha"], a["beta"]),
                                  eps=a["epsilon"], weight_decay=a["weight_decay"])
    data = np.load(directory / "data.npz")
    x, labels = torch.from_numpy(data["input"]), torch.from_numpy(data["labels"].astype(np.int64))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> float:
        loss = loss_fn(model(x), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())

    first = step()
    for _ in range(WARMUP - 1):
        step()
    return {"median_ms": median_ms(step, steps), "first_loss": first, "steps": steps, "threads": threads}


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
    x, y = data["input"], labels_of(directory, data)
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
    t.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time by the wall clock or by the process's CPU time (all threads)")
    c = sub.add_parser("bench")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--artifact", type=Path, default=CNN)
    c.add_argument("--batches", type=int, nargs="+", default=[4, 64, 256])
    c.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    c.add_argument("--steps", type=int, default=20)
    c.add_argument("--architectures", nargs="*", default=list(ARCHITECTURES),
                   help="committed artifacts beside --artifact, each timed at its own batch (default: %(default)s)")
    tt = sub.add_parser("torch")
    tt.add_argument("directory", type=Path)
    tt.add_argument("--steps", type=int, default=30)
    tt.add_argument("--threads", type=int, default=2)
    pr = sub.add_parser("profile")
    pr.add_argument("directory", type=Path)
    pr.add_argument("--steps", type=int, default=20)
    pr.add_argument("--threads", type=int, default=2)
    g = sub.add_parser("generate")
    g.add_argument("directory", type=Path)
    g.add_argument("--runs", type=int, default=5)
    g.add_argument("--once", action="store_true", help="one run in this process (what --runs spawns)")
    mem = sub.add_parser("memory")
    mem.add_argument("directory", type=Path)
    mem.add_argument("--steps", type=int, default=5)
    mem.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.command == "torch":
        print(json.dumps(time_torch(args.directory, args.steps, args.threads)))
    elif args.command == "profile":
        print(json.dumps(profile_native(args.directory, args.steps, args.threads)))
    elif args.command == "generate":
        print(json.dumps(time_generate(args.directory) if args.once else generate_runs(args.directory, args.runs)))
    elif args.command == "memory":
        print(json.dumps(memory_native(args.directory, args.steps, args.threads)))
    elif args.command == "make":
        make(args.network, args.batch, args.out)
    elif args.command == "bench":
        result = bench(args.artifact, args.batches, args.threads, args.steps, args.architectures)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    else:
        print(json.dumps(time_native(args.directory, args.steps, args.threads, args.spin, clock=args.clock)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
