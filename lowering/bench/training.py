"""``oplower bench --training``: a train step of the committed CNN on plain onnxruntime against torch's eager step.

The onnxruntime side is the committed onnxruntime-training artifact (``tests/fixtures/ort_training/artifacts/
cnn``), lowered once (:func:`lowering.training.lower_artifacts`): one step = the training model (IOBinding,
parameters and outputs in caller-owned buffers) + the optimizer model (its inputs are tensor sequences, which
IOBinding cannot bind from Python, so it is a plain ``run``), parameters, moments and step counter carried.
The torch side is the same network built in torch (``tools/ort_training/make_artifacts.py``'s ``cnn``), the
same initial weights (``initial_params.npz``), the same data, CrossEntropyLoss and AdamW with the optimizer
model's hyperparameters: forward + backward + ``optimizer.step()`` + ``zero_grad()``. Both sides' first-step
losses are compared once (a sanity check that they compute the same thing), then single steps are timed
interleaved with busy pauses, as in the rest of ``lowering.bench``.

The artifact's graphs have a static batch (4 at 3x8x8: every activation's declared type says so). A larger
batch is timed on a copy whose data inputs and activation types are re-declared (:func:`with_batch`); the
spatial size cannot change the same way (pool gradients and grouped ConvGrad take spatial sizes from the
declared types), and a different network would need onnxruntime-training to produce its training graph.

The train-step column times what ``oplower train`` runs: :class:`lowering.training.Trainer` with the train-step
model (one bound session run per step). The onnxruntime-training column comes from a JSON that
``tools/ort_training/native_step.py bench`` writes in onnxruntime-training's own venv (its ``Module`` +
``Optimizer`` step at the same batches and thread counts; the two cannot share a process); without that file
the column is left empty and the markdown says so. Its ratio is train-step / onnxruntime-training.

ConvGrad's share comes from onnxruntime's profiler: lowered node names start with the training node's name
they came from, so every kernel's time is charged to that node's op type.

Kernels per step: the train-step model's kernels (what ``oplower train`` runs, onnxruntime's profiler, a run of
its own) charged the same way to the training-graph op they came from (the model's own standard nodes by op
type, the optimizer update apart); beside them, given the JSON, onnxruntime-training's training-session kernels
by op type and its optimizer model's kernels. On tiny models the count decides the step: each kernel costs
about half a microsecond before it does any work (``tools/kernel_floor.py``).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from lowering.modelio import load_model
from lowering.training.trainer import (
    BUFFER_SUFFIX,
    LAZY_RESET,
    OPTIMIZER_MODEL,
    TRAINING_MODEL,
    StartingPoint,
    Trainer,
    TrainingModels,
    initial_parameters,
    lower_artifacts,
)
from opdef.errors import ModelError

CNN_ARTIFACTS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "ort_training" / "artifacts" / "cnn"
# issue 19's committed artifacts, each timed at its own batch beside the CNN (no torch side: onnxruntime only)
ARCHITECTURES = ("bert", "bert_torch", "gpt", "vit", "mobilenet", "mlp_act", "lstm")
BATCHES = (4, 64, 256)
FORWARD = "forward (standard ops)"  # nodes that no training op was lowered into
UPDATE = "optimizer (update)"  # the train-step model's update nodes (the optimizer model's op, lowered)
STANDARD = "{} (forward, standard)"  # the training model's own standard nodes, by op type
WARMUP_STEPS = 20  # untimed steps per side first: torch's first eager steps ran 10-30x slow here
LOSS_RTOL = 1e-4  # first-step losses: f32 on both sides, different kernels and summation orders
NATIVE_TOOL = "tools/ort_training/native_step.py bench"


class NativeTimesError(ModelError):
    """The onnxruntime-training JSON cannot be read or is not for this bench."""


def load_native(path: Path, artifact: str = "cnn") -> dict[tuple, dict]:
    """``native_step.py bench``'s JSON as {(batch, threads): its row} for ``artifact`` and {(name, threads): its
    row} for the other committed artifacts; each row has ``median_ms`` and, from JSONs that count them,
    ``kernels`` ({op type: [kernel ms, kernels] per step}) and ``optimizer_kernels``. One-line errors for a
    bad file."""
    times = load_native_times(path, artifact)
    result = json.loads(Path(path).read_text())
    rows: dict[tuple, dict] = {key: {"median_ms": ms} for key, ms in times.items()}
    for r in result["steps"]:
        rows[(int(r["batch"]), int(r["threads"]))].update(_native_kernels(path, r))
    for r in result.get("architectures") or []:
        try:
            key, ms = (str(r["artifact"]), int(r["threads"])), float(r["median_ms"])
        except (KeyError, TypeError, ValueError):
            raise NativeTimesError(f"{path}: an architecture without artifact, threads and median_ms") from None
        rows[key] = {"median_ms": ms, **_native_kernels(path, r)}
    return rows


def _native_kernels(path: Path, row: dict) -> dict:
    if "kernels" not in row:
        return {}
    try:
        kernels = {str(op): [float(v[0]), float(v[1])] for op, v in row["kernels"].items()}
        return {"kernels": kernels, "optimizer_kernels": int(row.get("optimizer_kernels", 1))}
    except (AttributeError, TypeError, ValueError, IndexError):
        raise NativeTimesError(f"{path}: kernels must map op types to [ms, kernels per step]") from None


def load_native_times(path: Path, artifact: str = "cnn") -> dict[tuple[int, int], float]:
    """{(batch, threads): median ms} from ``native_step.py bench``'s JSON; one-line errors for a bad file."""
    try:
        result = json.loads(Path(path).read_text())
    except OSError as exc:
        raise NativeTimesError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise NativeTimesError(f"{path}: not JSON ({exc})") from None
    if not isinstance(result, dict) or result.get("tool") != NATIVE_TOOL or not isinstance(result.get("steps"), list):
        raise NativeTimesError(f"{path}: not a JSON written by {NATIVE_TOOL}")
    if result.get("artifact") != artifact:
        raise NativeTimesError(f"{path}: times the {result.get('artifact')!r} artifact, the bench runs {artifact!r}")
    try:
        return {(int(r["batch"]), int(r["threads"])): float(r["median_ms"]) for r in result["steps"]}
    except (KeyError, TypeError, ValueError):
        raise NativeTimesError(f"{path}: a step without batch, threads and median_ms") from None


def with_batch(model: onnx.ModelProto, batch: int, params: set[str]) -> onnx.ModelProto:
    """A copy of the training model with ``batch`` samples: the data inputs' and the activations' leading dim
    (those declared with the original batch, parameter gradients excluded) re-declared."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    data = [i for i in graph.input if i.name not in params and not i.name.endswith(BUFFER_SUFFIX)
            and i.name != LAZY_RESET]
    old = data[0].type.tensor_type.shape.dim[0].dim_value
    for value in (*data, *graph.value_info):
        dims = value.type.tensor_type.shape.dim
        gradient = any(value.name.startswith(p + "_grad") for p in params)
        if len(dims) and dims[0].dim_value == old and not gradient:
            dims[0].dim_value = batch
    return model


def artifacts_at_batch(directory: Path, batch: int, workdir: Path) -> Path:
    """``directory`` itself at its own batch, else a copy in ``workdir`` re-declared for ``batch``."""
    training = load_model(directory / TRAINING_MODEL)
    data = training.graph.input[0].type.tensor_type.shape.dim
    if data and data[0].dim_value == batch:
        return directory
    params = set(np.load(directory / "initial_params.npz").files)
    target = workdir / f"batch{batch}"
    target.mkdir()
    onnx.save(with_batch(training, batch, params), target / TRAINING_MODEL)
    onnx.save(load_model(directory / OPTIMIZER_MODEL), target / OPTIMIZER_MODEL)
    return target


def adamw_hyperparameters(directory: Path) -> dict:
    """The optimizer model's AdamWOptimizer attributes, in torch.optim.AdamW's terms (plus ``adam_mode``)."""
    model = load_model(directory / OPTIMIZER_MODEL)
    node = next((n for n in model.graph.node if n.op_type == "AdamWOptimizer"), None)
    if node is None:
        raise ModelError(f"{directory / OPTIMIZER_MODEL}: no AdamWOptimizer node (the bench times AdamW)")
    from opdef.registry import load_schemas

    # attributes the node omits take the spec's defaults (specs/com.microsoft/AdamWOptimizer.rst)
    a = {attr.name: attr.default for attr in load_schemas().schema(node.domain, node.op_type).attributes}
    a.update({attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute})
    return {"betas": (float(a["alpha"]), float(a["beta"])), "eps": float(a["epsilon"]),
            "weight_decay": float(a["weight_decay"]), "adam_mode": int(a["adam_mode"])}


def learning_rate(directory: Path) -> float:
    meta = directory / "meta.json"
    return float(json.loads(meta.read_text())["learning_rate"]) if meta.exists() else 1e-3


class OrtTrainStep:
    """One train step (training model, then optimizer model) on plain onnxruntime, state carried."""

    def __init__(self, models: TrainingModels, start: StartingPoint, data: dict[str, np.ndarray], lr: float,
                 profile_prefix: str | None = None, threads: int | None = None) -> None:
        options = ort.SessionOptions()
        options.log_severity_level = 4
        options.inter_op_num_threads = 1
        if threads is not None:
            options.intra_op_num_threads = threads
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # no spinning: idle workers that spin steal the 2 cores from torch and from the other session
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CPUExecutionProvider"]
        self.optimizer = ort.InferenceSession(models.optimizer.SerializeToString(), options, providers=providers)
        if profile_prefix is not None:  # the training model only: the optimizer is timed by the clock (its
            options.enable_profiling = True  # Loop's many tiny kernels would mostly time the profiler)
            options.profile_file_prefix = profile_prefix
        self.training = ort.InferenceSession(models.training.SerializeToString(), options, providers=providers)
        self.params = [np.array(start.params[p]) for p in models.params]  # updated in place: bound below
        self.moments = ([np.zeros_like(p) for p in self.params], [np.zeros_like(p) for p in self.params])
        self.lr = np.array([lr], np.float32)
        self.step_count = 0
        outputs = {o.name: o for o in self.training.get_outputs()}
        self._buffers = [np.zeros_like(p) for p in self.params]
        self._grads = [np.zeros_like(p) for p in self.params]  # the accumulators' new buffers
        self._keep = []  # arrays and OrtValues the binding points into
        binding = self.training.io_binding()
        self._frozen = {name: np.array(value) for name, value in start.frozen.items()}  # bound below
        feeds = {**data, **self._frozen, LAZY_RESET: np.array([True])}
        feeds.update(zip(models.params, self.params, strict=True))
        feeds.update({p + BUFFER_SUFFIX: b for p, b in zip(models.params, self._buffers, strict=True)})
        for name, array in feeds.items():
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))  # shares the array's memory
            self._keep += [array, value]
            binding.bind_ortvalue_input(name, value)
        self.loss = np.zeros((), np.float32)
        bound = {models.loss: self.loss}
        bound.update({f"{p}{BUFFER_SUFFIX}.updated": g for p, g in zip(models.params, self._grads, strict=True)})
        # batch norm's running statistics, updated in place (their '<input>.updated' outputs): carried into the
        # bound frozen inputs after each step, as onnxruntime-training's API (and torch) update them
        self._running = {f"{name}.updated": np.zeros_like(value) for name, value in self._frozen.items()
                         if f"{name}.updated" in outputs}
        bound.update(self._running)
        for name in outputs:
            if name not in bound:  # the accumulators' update flags
                bound[name] = np.zeros([d if isinstance(d, int) else 1 for d in outputs[name].shape], np.bool_)
        for name, array in bound.items():
            value = ort.OrtValue.ortvalue_from_numpy(array)
            self._keep += [array, value]
            binding.bind_ortvalue_output(name, value)
        self._binding = binding
        self._opt_outputs = [o.name for o in self.optimizer.get_outputs()
                             if o.name in ("params.updated", "first_order_moments.updated",
                                           "second_order_moments.updated")]

    def __call__(self) -> float:
        self.train_part()
        self.optimizer_part()
        return float(self.loss)

    def train_part(self) -> None:
        self.training.run_with_iobinding(self._binding)
        for name, value in self._running.items():
            np.copyto(self._frozen[name.removesuffix(".updated")], value)

    def optimizer_part(self) -> None:
        self.step_count += 1
        feeds = {"learning_rate": self.lr, "step": np.array([self.step_count], np.int64), "params": self.params,
                 "gradients": self._grads, "first_order_moments": self.moments[0],
                 "second_order_moments": self.moments[1]}
        updated = dict(zip(self._opt_outputs, self.optimizer.run(self._opt_outputs, feeds), strict=True))
        for param, new in zip(self.params, updated["params.updated"], strict=True):
            np.copyto(param, new)  # the training binding reads these arrays
        self.moments = (updated["first_order_moments.updated"], updated["second_order_moments.updated"])

    def end_profiling(self) -> Path:
        return Path(self.training.end_profiling())


def torch_cnn(torch):
    """``tools/ort_training/make_artifacts.py``'s ``cnn`` (the committed artifact's network; meta.json)."""
    nn = torch.nn

    class Residual(nn.Module):
        def __init__(self, channels: int):
            super().__init__()
            self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(channels)

        def forward(self, x):
            return torch.relu(self.bn(self.conv(x))) + x

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, stride=1, padding=1),
        Residual(8), nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),
        nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def torch_train_step(torch, initial: dict[str, np.ndarray], data: dict[str, np.ndarray], lr: float,
                     hyper: dict) -> Callable[[], object]:
    """torch's eager train step of :func:`torch_cnn` from ``initial``; each call returns its loss (a tensor)."""
    model = torch_cnn(torch)
    state = model.state_dict()
    # every parameter and running statistic of the artifact, and nothing else (num_batches_tracked stays)
    expected = {k for k in state if not k.endswith("num_batches_tracked")}
    if expected != set(initial):
        raise ModelError(f"torch's cnn does not match initial_params.npz: {sorted(expected ^ set(initial))[:3]}")
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in initial.items()}, strict=False)
    model.train()
    # adam_mode 1 (Hugging Face's AdamW) adds epsilon to the uncorrected root of the second moment, torch to
    # the corrected one: the updates differ by epsilon's scale only, the work timed is the same
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=hyper["betas"], eps=hyper["eps"],
                                  weight_decay=hyper["weight_decay"])
    loss_fn = torch.nn.CrossEntropyLoss()
    x, labels = torch.from_numpy(data["input"]), torch.from_numpy(data["labels"].astype(np.int64))

    def step():
        loss = loss_fn(model(x), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def batch_data(directory: Path, batch: int) -> dict[str, np.ndarray]:
    """The artifact's own data at its batch; otherwise seeded random data of the same kind."""
    data = dict(np.load(directory / "data.npz"))
    if data["input"].shape[0] == batch:
        return data
    rng = np.random.default_rng(batch)
    classes = 4  # the cnn's Linear(8, 4)
    return {"input": rng.standard_normal((batch, *data["input"].shape[1:]), dtype=np.float32),
            "labels": rng.integers(0, classes, batch).astype(data["labels"].dtype)}


def origins(model: onnx.ModelProto, lowered: onnx.ModelProto) -> dict[str, str]:
    """Name -> op type of every node of ``model`` that the lowering replaced (its name is gone from ``lowered``;
    the nodes emitted for it carry it as their prefix)."""
    kept = {n.name for n in lowered.graph.node}
    return {n.name: n.op_type for n in model.graph.node if n.name and n.name not in kept}


def profile_train_step(models: TrainingModels, start: StartingPoint, batch: dict[str, np.ndarray], lr: float,
                       raw: onnx.ModelProto, threads: int | None, steps: int,
                       detail: dict[str, dict[str, list[float]]] | None = None) -> dict[str, list[float]]:
    """{training-graph op: [kernel ms per step, kernels per step]} of the train-step model's steps (what
    :class:`Trainer` runs, onnxruntime's profiler, 10 unprofiled-in-the-count warm-up steps first): each lowered
    kernel charged to the ``raw`` training-model node it came from (its op type), the model's own standard nodes
    to ``STANDARD`` of their op type, the update's nodes to ``UPDATE``. ``detail``, when given, receives the same
    split by lowered op type under each key."""
    charged = origins(raw, models.step.model if models.step is not None else models.training)
    standard = {n.name: n.op_type for n in raw.graph.node if n.name and n.name not in charged}
    names = sorted(charged, key=len, reverse=True)
    warmup = 10
    with tempfile.TemporaryDirectory() as work:
        class Profiled(Trainer):  # the Trainer's own session settings, with onnxruntime's profiler on
            @staticmethod
            def _session(model, options, what):
                options.enable_profiling = True
                options.profile_file_prefix = str(Path(work) / "lowered")
                return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

        trainer = Profiled(models, start, learning_rate=lr, threads=threads, spinning=False)
        for _ in range(warmup + steps):
            trainer.step(batch)
        # without the train-step model (an optimizer it does not join): the training model, then the optimizer
        # model, whose kernels are all the update
        sessions = [(trainer._bound.session, False)] if trainer._bound is not None else [
            (trainer._training, False), (trainer._optimizer, True)]
        events = [(e, update) for session, update in sessions
                  for e in json.loads(Path(session.end_profiling()).read_text())]
    runs = sorted(e["ts"] for e, _ in events if e.get("name") == "model_run")
    first = runs[warmup * len(sessions)]
    groups: dict[str, list[float]] = {}
    for e, update in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < first:
            continue
        node = e["name"][: -len("_kernel_time")]
        if update or node.startswith("train_step/"):
            key = UPDATE
        elif node in standard:
            key = STANDARD.format(standard[node])
        else:
            key = next((charged[o] for o in names if node.startswith(o + "/")), STANDARD.format(e["args"]["op_name"]))
        entries = [groups.setdefault(key, [0.0, 0.0])]
        if detail is not None:
            entries.append(detail.setdefault(key, {}).setdefault(e["args"]["op_name"], [0.0, 0.0]))
        for entry in entries:
            entry[0] += e["dur"] / 1e3 / steps
            entry[1] += 1 / steps
    return groups


def kernel_rows(lowered: dict[str, list[float]], native: dict[str, list[float]] | None) -> list[dict]:
    """One row per training-graph op, largest kernel time first: ``op``, the lowered ``kernels`` and ``ms`` per
    step, and onnxruntime-training's ``native_kernels`` and ``native_ms`` (its kernels are the training graph's
    own ops after its fusions, by op type: a forward op type the lowered graph does not have, e.g. FusedConv, or
    a training op with no lowered counterpart, e.g. the gradient accumulators the train-step model does not
    need, is a row of its own). The update (``UPDATE``) is left out."""
    ops = dict(native or {})
    rows = []
    for key, value in lowered.items():
        if key == UPDATE:
            continue
        name = key[: -len(STANDARD.format(""))] if key.endswith(STANDARD.format("")) else key
        theirs = ops.pop(name, None)
        rows.append({"op": key, "kernels": value[1], "ms": value[0],
                     "native_kernels": None if theirs is None else theirs[1],
                     "native_ms": None if theirs is None else theirs[0]})
    for name, value in ops.items():
        rows.append({"op": STANDARD.format(name) if onnx.defs.has(name) else f"{name} (native only)", "kernels": None,
                     "ms": None, "native_kernels": value[1], "native_ms": value[0]})
    rows.sort(key=lambda r: -max(r["ms"] or 0.0, r["native_ms"] or 0.0))
    return rows


def kernel_summary(lowered: dict[str, list[float]], native: dict | None) -> dict:
    """Kernels per step in all, both sides (``native``: a row of :func:`load_native`, None when not measured)."""
    ours = sum(v[1] for v in lowered.values())
    theirs = None
    if native is not None and "kernels" in native:
        theirs = sum(v[1] for v in native["kernels"].values()) + native["optimizer_kernels"]
    return {"kernels_total": round(ours), "update_kernels": round(lowered.get(UPDATE, [0.0, 0.0])[1]),
            "ort_training_kernels": None if theirs is None else round(theirs)}


def kernel_markdown(lowered: dict[str, list[float]], native: dict | None) -> list[str]:
    """The kernel table: one row per training-graph op, the update, and the totals."""
    lines = ["| training-graph op | kernels | kernel ms | onnxruntime-training kernels | its kernel ms |",
             "|---|---:|---:|---:|---:|"]

    def cell(value, fmt):
        return "–" if value is None else format(value, fmt)

    for r in kernel_rows(lowered, None if native is None else native.get("kernels")):
        lines.append(f"| {r['op']} | {cell(r['kernels'], '.0f')} | {cell(r['ms'], '.3f')} | "
                     f"{cell(r['native_kernels'], '.0f')} | {cell(r['native_ms'], '.3f')} |")
    update = lowered.get(UPDATE, [0.0, 0.0])
    native_update = "–" if native is None or "kernels" not in native else f"{native['optimizer_kernels']}"
    lines.append(f"| {UPDATE} | {update[1]:.0f} | {update[0]:.3f} | {native_update} (own session) | – |")
    summary = kernel_summary(lowered, native)
    lines.append(f"| **all** | {summary['kernels_total']} | {sum(v[0] for v in lowered.values()):.3f} | "
                 f"{cell(summary['ort_training_kernels'], 'd')} | – |")
    return lines


def profile_shares(path: Path, training_origins: dict[str, str], steps: int) -> dict:
    """The training model's kernel time per step by origin op type (``FORWARD`` for the model's own standard
    nodes), each origin's time split by lowered op type; ``share`` is of the training model's kernel time."""
    names = sorted(training_origins, key=len, reverse=True)
    groups: dict[str, dict[str, float]] = {}
    for event in json.loads(path.read_text()):
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        node = event["name"][: -len("_kernel_time")]
        origin = next((training_origins[o] for o in names if node.startswith(o + "/")), FORWARD)
        op = event.get("args", {}).get("op_name", "?")
        groups.setdefault(origin, {}).setdefault(op, 0.0)
        groups[origin][op] += event["dur"] / 1e3 / steps
    total = sum(sum(g.values()) for g in groups.values())
    rows = [{"origin": origin, "ms": sum(ops.values()), "share": sum(ops.values()) / total if total else 0.0,
             "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}
            for origin, ops in groups.items()]
    return {"kernel_ms": total, "rows": sorted(rows, key=lambda r: -r["ms"])}


def profile(models: TrainingModels, start: StartingPoint, data: dict, lr: float, training_origins: dict[str, str],
            steps: int, workdir: Path, threads: int | None = None) -> dict:
    """Kernel times by origin (profiled steps), and the two models' wall-clock times per step (unprofiled)."""
    workdir.mkdir(parents=True)
    profiled = OrtTrainStep(models, start, data, lr, profile_prefix=str(workdir / "training"), threads=threads)
    for _ in range(steps):
        profiled()
    result = profile_shares(profiled.end_profiling(), training_origins, steps)
    plain = OrtTrainStep(models, start, data, lr, threads=threads)
    parts: dict[str, list[float]] = {"training_ms": [], "optimizer_ms": []}
    for k in range(WARMUP_STEPS + steps):
        for key, part in (("training_ms", plain.train_part), ("optimizer_ms", plain.optimizer_part)):
            t0 = time.perf_counter()
            part()
            if k >= WARMUP_STEPS:
                parts[key].append(time.perf_counter() - t0)
    result.update({key: statistics.median(times) * 1e3 for key, times in parts.items()})
    conv = next((r["share"] for r in result["rows"] if r["origin"] == "ConvGrad"), 0.0)
    # ConvGrad's share of the whole step: of the training model's kernels, times the training model's part
    result["conv_grad_share_of_step"] = conv * result["training_ms"] / (result["training_ms"] + result["optimizer_ms"])
    return result


def time_training(directory: Path, batch: int, reps: int, torch, workdir: Path,
                  progress: Callable[[str], None], profile_steps: int = 20, threads: int = 1) -> dict:
    """One row: ``threads`` intra-op threads on both sides (onnxruntime's pool, torch.set_num_threads)."""
    from lowering.bench import _interleaved, _median_ms

    source = artifacts_at_batch(directory, batch, workdir)
    models = lower_artifacts(source)
    initial = dict(np.load(directory / "initial_params.npz"))
    start = initial_parameters(directory, models, initial, source=str(directory / "initial_params.npz"))
    data = batch_data(directory, batch)
    lr = learning_rate(directory)
    ort_step = OrtTrainStep(models, start, data, lr, threads=threads)
    trainer = Trainer(models, start, learning_rate=lr, threads=threads, spinning=False)
    runners: dict[str, Callable[[], object]] = {"ort": ort_step, "step": lambda: trainer.step(data)}
    row: dict = {"threads": threads, "batch": batch, "input": list(data["input"].shape),
                 "redeclared": source != directory,
                 "lowered_nodes": len(models.training.graph.node), "ms": None, "torch_ms": None, "vs_torch": None,
                 "loss_ort": None, "loss_torch": None, "loss_rel_diff": None, "losses_agree": None}
    row["loss_ort"] = ort_step()  # the first step, from the initial parameters
    if torch is not None:
        torch.set_num_threads(threads)
        torch_step = torch_train_step(torch, initial, data, lr, adamw_hyperparameters(directory))
        row["loss_torch"] = float(torch_step())
        row["loss_rel_diff"] = abs(row["loss_ort"] - row["loss_torch"]) / abs(row["loss_torch"])
        runners["torch"] = torch_step
        row["losses_agree"] = row["loss_rel_diff"] <= LOSS_RTOL
        verdict = "agree" if row["losses_agree"] else f"DISAGREE (beyond {LOSS_RTOL:g})"
        progress(f"    first-step loss: onnxruntime {row['loss_ort']:.7f}, torch {row['loss_torch']:.7f} "
                 f"(relative difference {row['loss_rel_diff']:.1e}: {verdict})")
    for _ in range(WARMUP_STEPS):
        for fn in runners.values():
            fn()
    times = _interleaved(runners, reps)
    row["ms"] = _median_ms(times["ort"])
    row["step_ms"] = _median_ms(times["step"])
    if "torch" in times:
        row["torch_ms"] = _median_ms(times["torch"])
        row["vs_torch"] = row["ms"] / row["torch_ms"]
    raw = load_model(source / TRAINING_MODEL)
    row["profile"] = profile(models, start, data, lr, origins(raw, models.training), profile_steps,
                             workdir / "profile", threads)
    row["kernels"] = profile_train_step(models, start, data, lr, raw, threads, profile_steps)
    row.update(kernel_summary(row["kernels"], None))
    return row


def time_architecture(directory: Path, reps: int, threads: int, profile_steps: int = 20) -> dict:
    """One train step (training + optimizer model, lowered) of a committed artifact at its own batch and data:
    the median time and the first-step loss against onnxruntime-training's recorded one; the train-step model's
    median time (``step_ms``, what ``oplower train`` runs, interleaved) and its kernels per step by training-graph
    op. An artifact that does not lower yet is a row with its ``error`` instead of a failed bench."""
    from lowering.bench import _interleaved, _median_ms
    from opdef.errors import OplowerError

    row: dict = {"artifact": directory.name, "threads": threads, "batch": None, "lowered_nodes": None, "ms": None,
                 "step_ms": None, "loss_ort": None, "loss_recorded": None, "loss_rel_diff": None, "error": None,
                 "kernels": None}
    try:
        models = lower_artifacts(directory)
    except OplowerError as exc:
        row["error"] = " ".join(str(exc).split())
        return row
    meta = json.loads((directory / "meta.json").read_text())
    initial = dict(np.load(directory / "initial_params.npz"))
    start = initial_parameters(directory, models, initial, source=str(directory / "initial_params.npz"))
    data = dict(np.load(directory / "data.npz"))
    feeds = {models.training.graph.input[0].name: data["input"], meta["labels_input"]: data["labels"]}
    lr = learning_rate(directory)
    step = OrtTrainStep(models, start, feeds, lr, threads=threads)
    trainer = Trainer(models, start, learning_rate=lr, threads=threads, spinning=False)
    row["batch"] = int(data["input"].shape[0])
    row["lowered_nodes"] = len(models.training.graph.node) + len(models.optimizer.graph.node)
    row["loss_ort"] = step()
    row["loss_recorded"] = float(json.loads((directory / "api_curve.json").read_text())["loss"][0])
    row["loss_rel_diff"] = abs(row["loss_ort"] - row["loss_recorded"]) / abs(row["loss_recorded"])
    runners = {"ort": step, "step": lambda: trainer.step(feeds)}
    for _ in range(WARMUP_STEPS):
        for fn in runners.values():
            fn()
    times = _interleaved(runners, reps)
    row["ms"], row["step_ms"] = _median_ms(times["ort"]), _median_ms(times["step"])
    row["kernels"] = profile_train_step(models, start, feeds, lr, load_model(directory / TRAINING_MODEL), threads,
                                        profile_steps)
    row.update(kernel_summary(row["kernels"], None))
    return row


def conv_grad_formulation() -> str:
    """How ConvGrad is lowered: the first sentence of each output's bullet in the rule's docstring."""
    from lowering.rules import conv_grad

    text = " ".join(line.strip() for line in (conv_grad.__doc__ or "").splitlines())
    bullets = [part for part in text.split(" - ") if part.startswith("``d")]
    return " ".join(b.split("; ")[0].split(". ")[0].rstrip(".").replace("``", "") + "." for b in bullets)


def run_training_bench(*, batches: tuple[int, ...] = BATCHES, reps: int = 15, use_torch: bool = True,
                       threads: tuple[int, ...] | None = None, directory: Path = CNN_ARTIFACTS,
                       profile_steps: int = 20, native: Path | None = None,
                       architectures: tuple[str, ...] = ARCHITECTURES,
                       progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Every batch at each thread count (default: 1 and every core; on a shared 2-core VM the one-thread rows
    are the ones other processes disturb least: torch's OpenMP regions wait for their slowest thread)."""
    from lowering.bench import _torch, keep_freed_memory, machine

    if not (directory / TRAINING_MODEL).exists():
        raise ModelError(f"{directory}: no {TRAINING_MODEL} (the bench needs the committed CNN artifacts of "
                         "tests/fixtures/ort_training, i.e. a source checkout)")
    native_rows = load_native(native, directory.name) if native is not None else {}
    cores = max(1, machine()["cores"] or 1)
    threads = threads or tuple(sorted({1, cores}))
    torch = _torch() if use_torch else None
    if torch is not None:
        keep_freed_memory()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for count in threads:
            for batch in batches:
                progress(f"[training] cnn train step, batch {batch}, {count} thread{'s' * (count > 1)}")
                sub = Path(workdir) / f"run{count}_{batch}"
                sub.mkdir()
                row = time_training(directory, batch, reps, torch, sub, progress, profile_steps, count)
                _add_native(row, native_rows.get((batch, count)))
                extra = f", torch {row['torch_ms']:.2f} ms ({row['vs_torch']:.2f}x)" if row["torch_ms"] else ""
                progress(f"    {row['ms']:.2f} ms{extra}")
                rows.append(row)
    others = []
    for count in threads:
        for name in architectures:
            progress(f"[training] {name} train step, {count} thread{'s' * (count > 1)}")
            other = time_architecture(directory.parent / name, reps, count, profile_steps)
            if other["error"] is None:
                _add_native(other, native_rows.get((name, count)))
            progress(f"    {other['ms']:.2f} ms" if other["error"] is None else f"    not lowered: {other['error']}")
            others.append(other)
    return {"machine": machine(), "torch": getattr(torch, "__version__", None), "reps": reps,
            "artifact": directory.name, "conv_grad_formulation": conv_grad_formulation(), "steps": rows,
            "ort_training_json": None if native is None else str(native), "architectures": others}


def _add_native(row: dict, native: dict | None) -> None:
    """onnxruntime-training's step time and kernels (a row of :func:`load_native`, None: not measured) into a
    timed row: ``ort_training_ms``, ``vs_ort_training`` (train-step ms / its ms), ``ort_training_kernels`` and
    its kernels by op type (``native``)."""
    native_ms = None if native is None else native["median_ms"]
    row["ort_training_ms"] = native_ms
    row["vs_ort_training"] = row["step_ms"] / native_ms if native_ms else None
    row["native"] = native
    row.update(kernel_summary(row["kernels"], native))


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _count(value: int | None) -> str:
    return "–" if value is None else str(value)


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores; onnxruntime {m['onnxruntime']}; torch "
             f"{result['torch'] or 'not installed'}; one train step of the committed `{result['artifact']}` "
             "artifact (training + optimizer model, lowered) against torch eager (forward, backward, AdamW step, "
             f"zero_grad); median of {result['reps']} steps, interleaved.", "",
             "| threads | batch | input | ms | training + optimizer ms | torch ms | × torch | first-step loss "
             "(ort / torch) | ConvGrad share | train-step ms | onnxruntime-training ms | × onnxruntime-training | "
             "kernels per step | onnxruntime-training kernels |",
             "|---:|---:|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["steps"]:
        p = r["profile"]
        t_ms = f"{r['torch_ms']:.2f}" if r["torch_ms"] else "–"
        t_x = f"{r['vs_torch']:.2f}" if r["vs_torch"] else "–"
        torch_loss = f"{r['loss_torch']:.6f}" if r["loss_torch"] is not None else "–"
        shape = "×".join(map(str, r["input"])) + (" (re-declared)" if r["redeclared"] else "")
        lines.append(f"| {r['threads']} | {r['batch']} | {shape} | {r['ms']:.2f} | "
                     f"{p['training_ms']:.2f} + {p['optimizer_ms']:.2f} | "
                     f"{t_ms} | {t_x} | {r['loss_ort']:.6f} / {torch_loss} | {p['conv_grad_share_of_step']:.0%} | "
                     f"{r['step_ms']:.2f} | {_num(r.get('ort_training_ms'))} | {_num(r.get('vs_ort_training'))} | "
                     f"{r['kernels_total']} | {_count(r.get('ort_training_kernels'))} |")
    if result.get("ort_training_json") is None:
        lines += ["", "onnxruntime-training column: not measured (no --ort-training-json FILE; write one with "
                  f"`/path/to/ortt-venv/bin/python {NATIVE_TOOL} --out FILE` in onnxruntime-training's venv)."]
    else:
        lines += ["", f"onnxruntime-training column: its Module + Optimizer step, from {result['ort_training_json']} "
                  f"({NATIVE_TOOL}, run apart); × onnxruntime-training = train-step ms / onnxruntime-training ms."]
    for r in result["steps"]:
        p = r["profile"]
        lines += ["", f"Training model, batch {r['batch']}, {r['threads']} thread(s), {r['lowered_nodes']} "
                  "lowered nodes (onnxruntime's "
                  "profiler: kernel ms per step by the training op each lowered node came from; "
                  f"{p['kernel_ms']:.2f} ms in all):",
                  "", "| from | ms | share | top lowered ops (ms) |", "|---|---:|---:|---|"]
        for g in p["rows"]:
            top = ", ".join(f"{op} {ms:.3f}" for op, ms in list(g["ops"].items())[:4])
            lines.append(f"| {g['origin']} | {g['ms']:.3f} | {g['share']:.0%} | {top} |")
    widest = max((r["threads"] for r in result["steps"]), default=None)
    for r in result["steps"]:
        if r["threads"] != widest:
            continue
        lines += ["", f"Kernels per step, batch {r['batch']}, {r['threads']} thread(s): the train-step model (what "
                  "`oplower train` runs) by the training-graph op each kernel came from, kernel ms from onnxruntime's "
                  "profiler; onnxruntime-training's training session by op type, its optimizer session "
                  + ("apart:" if r.get("native") else "(not measured):"), "",
                  *kernel_markdown(r["kernels"], r.get("native"))]
    lines += ["", f"ConvGrad formulation: {result['conv_grad_formulation']}"]
    if result.get("architectures"):
        lines += ["", "Issue 19's committed artifacts (tests/fixtures/ort_training/artifacts), one train step each at "
                  "its own batch on plain onnxruntime (lowered training + optimizer model; train-step model), "
                  f"median of {result['reps']} steps, interleaved:", "",
                  "| artifact | threads | batch | lowered nodes | ms | first-step loss (ort / onnxruntime-training) | "
                  "train-step ms | onnxruntime-training ms | × onnxruntime-training | kernels per step | "
                  "onnxruntime-training kernels |",
                  "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        for r in result["architectures"]:
            if r["error"] is not None:
                lines.append(f"| {r['artifact']} | {r['threads']} | – | – | – | not lowered: {r['error']} "
                             "| – | – | – | – | – |")
                continue
            lines.append(f"| {r['artifact']} | {r['threads']} | {r['batch']} | {r['lowered_nodes']} | {r['ms']:.2f} | "
                         f"{r['loss_ort']:.6f} / {r['loss_recorded']:.6f} | {r['step_ms']:.2f} | "
                         f"{_num(r.get('ort_training_ms'))} | {_num(r.get('vs_ort_training'))} | "
                         f"{r['kernels_total']} | {_count(r.get('ort_training_kernels'))} |")
        widest = max((r["threads"] for r in result["architectures"]), default=None)
        for r in result["architectures"]:
            if r["error"] is None and r["threads"] == widest:
                lines += ["", f"Kernels per step, {r['artifact']} (batch {r['batch']}, {r['threads']} thread(s)):", "",
                          *kernel_markdown(r["kernels"], r.get("native"))]
    return "\n".join(lines)
