"""Training artifacts of small torch models and onnxruntime-training's results on them.

Called by make_fixtures.py (same environment). Per artifact directory ``artifacts/<name>/``:
- training_model.onnx, eval_model.onnx, optimizer_model.onnx (generate_artifacts' output) and
  checkpoint (kept small: the initial state);
- data.npz: ``input``, ``labels`` (the batch every recorded step uses);
- initial_params.npz: every parameter from the checkpoint, by name;
- api_step1.npz: the training API's first train step: ``loss``, ``grad.<param>``;
- api_optimizer_step1.npz: every parameter after the first optimizer step (``param.<name>``);
- api_curve.json: learning rate and the loss of 20 steps (train step, optimizer step, lazy reset);
- raw_train_step1.npz: training_model.onnx run by InferenceSession on explicit inputs (parameters,
  zero accumulation buffers, lazy_reset_grad=[True]): every graph output plus each buffer after the
  step as ``<buffer name>.updated``;
- raw_optimizer_step1.npz: optimizer_model.onnx run the same way on sequences (params, the raw
  gradients, zero moments, step=[1], the API's learning rate): the graph outputs and the updated
  sequences ``params.updated.<i>``, ``first_order_moments.updated.<i>``...;
- meta.json: parameter order, non-standard ops per model, shapes, the torch model's description;
- forward_model.onnx: the forward model exactly as torch exported it, the input of generate_artifacts
  *before* patch_forward (LayerNormalization without its Mean/InvStdDev outputs; nn.MultiheadAttention's
  Dropout without a mask output -- torch's training-mode export gives every other Dropout one) and with every
  Dropout's ratio as exported (0.1, 0.2, a Constant node's output): generate_artifacts gets a patched copy.
  Its initializers are initial_params.npz's values (the checkpoint is made from them), nothing else;
- torch_f64_step1.npz: the float64 truth of the first step: ``loss`` (0-d) and ``grad.<param>`` for every
  trainable parameter, keyed by its ONNX initializer name -- a deep copy of the torch module in float64
  (``.double()``) holding initial_params.npz's values (BatchNorm running stats too), every nn.Dropout's ``p``
  and nn.MultiheadAttention's ``dropout`` 0 (as the recorded graphs' zeroed ratios), in train() mode
  (BatchNorm on batch statistics), one backward on data.npz's batch with the loss generate_artifacts built
  (CrossEntropyLoss, MSELoss, BCEWithLogitsLoss, L1Loss: each reduction mean). Every initializer name is
  the torch name (state_dict key) of the same tensor, same shape, in every artifact: the exporter keeps
  the recurrent layers' ``rnn.weight_ih_l0``... in torch's layout [gates*hidden, in] and torch's gate order
  (its Slice/Concat nodes reorder them into ONNX's W/R/B), bert_torch's ``block.self_attn.in_proj_weight``
  [3*hidden, hidden] / ``in_proj_bias`` [3*hidden] stay one tensor each (one Transpose-MatMul-Add projects q,
  k and v together, three Gathers split the result), and gpt's head is tied: ``tok.weight`` is one
  initializer read by both the embedding's Gather and the head's Transpose (then MatMul), its gradient the
  sum of both uses (torch's too). make() checks all this (names, shapes, that every torch parameter is
  trainable and got a gradient) and prints the agreement with api_step1.npz.
"""

from __future__ import annotations

import copy
import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, Module, Optimizer
from torch import nn

STEPS = 20
BUFFER = "_grad.accumulation.buffer"
STANDARD = {"", "ai.onnx"}


class Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))) + x


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, stride=1, padding=1),
        Residual(8),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),          # strided: 8x8 -> 4x4
        nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.ReLU(),          # grouped
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),         # depthwise
        nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def cnn1d() -> nn.Module:
    # 1-D layers and the pooling options the 2-D net leaves at their defaults
    return nn.Sequential(
        nn.Conv1d(3, 6, 3, padding=1), nn.BatchNorm1d(6), nn.ReLU(),
        nn.MaxPool1d(2, stride=2, ceil_mode=True),                   # 11 -> 6
        nn.Conv1d(6, 6, 3, stride=2, padding=1, groups=3), nn.ReLU(),  # 6 -> 3
        nn.AvgPool1d(3, stride=1, padding=1, count_include_pad=False),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(6, 3))


def mlp(out: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, out))


class RecurrentClassifier(nn.Module):
    """nn.LSTM / nn.GRU (batch_first) over a [batch, seq, feature] input, then a Linear on the mean of the
    outputs over time and on the final hidden states (so the gradient op gets both dHAll and dHFinal). No
    indexing of the outputs (``out[-1]`` would bring a GatherGrad) and no dropout."""

    def __init__(self, cell: type, layers: int = 1, bidirectional: bool = False) -> None:
        super().__init__()
        self.rnn = cell(4, 6, num_layers=layers, bidirectional=bidirectional, batch_first=True)
        directions = 2 if bidirectional else 1
        self.head = nn.Linear(6 * directions + 6 * directions * layers, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        final = h.transpose(0, 1).reshape(x.shape[0], -1)
        return self.head(torch.cat([out.mean(1), final], dim=1))


def lstm() -> nn.Module:
    return RecurrentClassifier(nn.LSTM)


def gru() -> nn.Module:
    return RecurrentClassifier(nn.GRU)


def lstm2() -> nn.Module:
    return RecurrentClassifier(nn.LSTM, layers=2)


def randomize_batch_norm(model: nn.Module, gen: torch.Generator) -> None:
    # equal BN initializers (ones/zeros) get deduplicated by onnxruntime's optimizer and a running-stat
    # update can then overwrite an aliased scale or bias (DESIGN.md section 9): make them all distinct
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d):
                c = module.num_features
                module.weight.copy_(1.0 + 0.2 * torch.randn(c, generator=gen))
                module.bias.copy_(0.2 * torch.randn(c, generator=gen))
                module.running_mean.copy_(0.1 * torch.randn(c, generator=gen))
                module.running_var.copy_(1.0 + 0.3 * torch.rand(c, generator=gen))


# -- the architectures people train on device (issue 19): tiny, every Dropout's ratio patched to 0 ----------

VOCAB, SEQ, HIDDEN, HEADS, FFN = 16, 8, 8, 2, 16  # tiny: the fixtures store every parameter ~8 times


class Attention(nn.Module):
    """Hand-written multi-head self-attention: Linear q/k/v, MatMul, Softmax, Dropout (causal optional)."""

    def __init__(self, causal: bool = False):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.drop = nn.Dropout(0.1)
        self.causal = causal

    def forward(self, x):
        b, t, _ = x.shape
        d = HIDDEN // HEADS

        def heads(y):
            return y.reshape(b, t, HEADS, d).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) / d ** 0.5
        if self.causal:
            mask = torch.ones(t, t).triu(1).bool()
            scores = scores.masked_fill(mask, float("-inf"))
        attn = self.drop(torch.softmax(scores, dim=-1))
        return self.out(torch.matmul(attn, v).transpose(1, 2).reshape(b, t, HIDDEN))


class Block(nn.Module):
    """Post-norm (BERT) or pre-norm (GPT, ViT) encoder block with a GELU MLP."""

    def __init__(self, causal: bool = False, approximate: str = "none", pre_norm: bool = False):
        super().__init__()
        self.attn = Attention(causal)
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(approximate=approximate), nn.Linear(FFN, HIDDEN),
                                 nn.Dropout(0.1))
        self.pre_norm = pre_norm

    def forward(self, x):
        if self.pre_norm:
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.mlp(x))


class Bert(nn.Module):
    """Token + position embeddings, one encoder block, a classifier on the first token."""

    def __init__(self, torch_layer: bool = False, classes: int = 4):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)
        self.drop = nn.Dropout(0.1)
        self.block = (nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.1, activation="gelu",
                                                 batch_first=True) if torch_layer else Block())
        self.head = nn.Linear(HIDDEN, classes)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        x = self.drop(self.tok(tokens) + self.pos(positions))
        return self.head(self.block(x)[:, 0])


class Gpt(nn.Module):
    """A pre-norm causal block (erf GELU), learned positions sliced to the length, a tanh-GELU projection and a
    head tied to the token embedding; predicts the token after the last one."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(0.1 * torch.randn(1, 2 * SEQ, HIDDEN))
        self.block = Block(causal=True, pre_norm=True)
        self.norm = nn.LayerNorm(HIDDEN)
        self.proj = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(approximate="tanh"))

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos[:, : tokens.shape[1]]
        x = self.proj(self.norm(self.block(x))[:, -1])
        return torch.matmul(x, self.tok.weight.t())


class Vit(nn.Module):
    """Conv patch embedding (8x8 image, 4x4 patches), a cls token, positions, one pre-norm block."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.patch = nn.Conv2d(3, HIDDEN, 4, stride=4)
        self.cls = nn.Parameter(0.1 * torch.randn(1, 1, HIDDEN))
        self.pos = nn.Parameter(0.1 * torch.randn(1, 5, HIDDEN))
        self.block = Block(pre_norm=True)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, classes)

    def forward(self, image):
        x = self.patch(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.block(x))[:, 0])


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int = 2):
        super().__init__()
        mid = cin * expand
        self.layers = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
            nn.Conv2d(mid, mid, 3, stride=stride, padding=1, groups=mid, bias=False), nn.BatchNorm2d(mid),
            nn.ReLU6(), nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.layers(x)
        return x + y if self.residual else y


def mobilenet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),  # 8x8 -> 4x4
        InvertedResidual(8, 8, 1), InvertedResidual(8, 12, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(12, 4))


def mlp_act() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.SiLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
                         nn.LeakyReLU(0.1), nn.Linear(16, 3), nn.Softmax(dim=-1))


def perturb_constant_parameters(model: nn.Module, gen: torch.Generator) -> None:
    # LayerNorm's ones/zeros and attention's zero biases: distinct values, so no two parameters are equal
    # (onnxruntime deduplicates equal initializers; DESIGN.md section 9) and every gradient is exercised
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and bool((p == p.reshape(-1)[0]).all()):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def patch_forward(model: onnx.ModelProto) -> onnx.ModelProto:
    """What generate_artifacts needs and torch's export does not give (DESIGN.md section 9): every
    LayerNormalization also outputs Mean and InvStdDev; every Dropout outputs its mask (nn.MultiheadAttention's
    has none)."""
    for node in model.graph.node:
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([f"{node.output[0]}.mean", f"{node.output[0]}.inv_std_dev"])
        if node.op_type == "Dropout" and len(node.output) == 1:
            node.output.append(f"{node.output[0]}.mask")
    return model


def zero_dropout_ratios(path: Path) -> int:
    """Set the ratio of every Dropout and DropoutGrad in a generated model to 0, in place: the results are then
    comparable with another runtime (no random masks). Done after generate_artifacts, because onnxruntime's
    optimizer removes a forward Dropout of ratio 0 (and with it DropoutGrad) before building the gradient graph;
    the mask DropoutGrad reads keeps them in the session. Returns the number of nodes changed."""
    model = onnx.load(path)
    graph = model.graph
    positions = {"Dropout": 1, "DropoutGrad": 2}
    changed = 0
    replaced: set[str] = set()
    for node in graph.node:
        position = positions.get(node.op_type)
        if position is None or len(node.input) <= position or not node.input[position]:
            continue  # no ratio: the default 0.5 in training mode -- not generated here
        zero = f"{node.name or node.output[0]}.ratio0"
        graph.initializer.append(helper.make_tensor(zero, onnx.TensorProto.FLOAT, [], [0.0]))
        replaced.add(node.input[position])
        node.input[position] = zero
        changed += 1
    read = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name not in replaced or t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    onnx.save(model, path)
    return changed


# name: (model factory, input shape, labels kind, loss, optimizer[, options]); options: "vocab" (the input is
# token ids below it), "patch" (patch_forward the exported model)
ARTIFACTS = {
    "cnn": (cnn, (4, 3, 8, 8), ("class", 4), artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW),
    "mlp": (mlp, (4, 6), ("real", 3), artifacts.LossType.MSELoss, artifacts.OptimType.SGD),
    "mlp_bce": (mlp, (4, 6), ("binary", 3), artifacts.LossType.BCEWithLogitsLoss, artifacts.OptimType.AdamW),
    "mlp_l1": (mlp, (4, 6), ("real", 3), artifacts.LossType.L1Loss, artifacts.OptimType.SGD),
    "cnn1d": (cnn1d, (4, 3, 11), ("class", 3), artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.SGD),
    "bert": (Bert, (4, SEQ), ("class", 4), artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW,
             {"vocab": VOCAB, "patch": True}),
    "bert_torch": (lambda: Bert(torch_layer=True), (4, SEQ), ("class", 4), artifacts.LossType.CrossEntropyLoss,
                   artifacts.OptimType.AdamW, {"vocab": VOCAB, "patch": True}),
    "gpt": (Gpt, (4, SEQ), ("class", VOCAB), artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW,
            {"vocab": VOCAB, "patch": True}),
    "vit": (Vit, (4, 3, 8, 8), ("class", 4), artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW,
            {"patch": True}),
    "mobilenet": (mobilenet, (4, 3, 8, 8), ("class", 4), artifacts.LossType.CrossEntropyLoss,
                  artifacts.OptimType.AdamW, {"patch": True}),
    "mlp_act": (mlp_act, (4, 6), ("real", 3), artifacts.LossType.MSELoss, artifacts.OptimType.AdamW,
                {"patch": True}),
    "lstm": (lstm, (3, 5, 4), ("class", 3), artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW),
    "gru": (gru, (3, 5, 4), ("class", 3), artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW),
    "lstm2": (lstm2, (3, 5, 4), ("class", 3), artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW),
}


def non_standard_ops(path: Path) -> list[dict]:
    model = onnx.load(path)
    seen: dict[tuple, set] = {}
    for node in model.graph.node:
        standard = node.domain in STANDARD and onnx.defs.has(node.op_type, node.domain)
        if not standard:
            seen.setdefault((node.domain or "ai.onnx", node.op_type), set()).update(a.name for a in node.attribute)
    return [{"domain": d, "op_type": o, "attributes": sorted(a), "count": sum(
        1 for n in model.graph.node if n.op_type == o and (n.domain or "ai.onnx") == d)} for (d, o), a in
        sorted(seen.items())]


def _np_type(value_info) -> np.dtype:
    return onnx.helper.tensor_dtype_to_np_dtype(value_info.type.tensor_type.elem_type)


def make(name: str, out_root: Path, seed: int) -> dict:
    factory, in_shape, (label_kind, classes), loss, optim, *rest = ARTIFACTS[name]
    options = rest[0] if rest else {}
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = factory()
    randomize_batch_norm(model, gen)
    if options.get("patch"):
        perturb_constant_parameters(model, gen)
    model.train()
    directory = out_root / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    if "vocab" in options:
        x = torch.randint(0, options["vocab"], in_shape, generator=gen)
    else:
        x = torch.randn(*in_shape, generator=gen)
    forward = directory / "forward_model.onnx"
    torch.onnx.export(model, (x,), str(forward), input_names=["input"], output_names=["output"],
                      opset_version=17, do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING,
                      dynamo=False)
    exported = forward.read_bytes()  # kept as forward_model.onnx: unpatched, Dropout ratios as exported
    fwd = onnx.load_from_string(exported)  # generate_artifacts gets (and may change) a copy, patched if asked
    if options.get("patch"):
        fwd = patch_forward(fwd)
        trainable = {n for n, _ in model.named_parameters()}
        requires_grad = [init.name for init in fwd.graph.initializer if init.name in trainable]
    else:  # nn.LSTM / nn.GRU name theirs weight_ih_l0, bias_hh_l1_reverse ...
        requires_grad = [init.name for init in fwd.graph.initializer
                         if (init.name.endswith(("weight", "bias")) or ".weight_" in init.name or ".bias_" in init.name)
                         and "running" not in init.name]
    frozen = [init.name for init in fwd.graph.initializer if init.name not in requires_grad]
    artifacts.generate_artifacts(fwd, requires_grad=requires_grad, frozen_params=frozen, loss=loss,
                                 optimizer=optim, artifact_directory=str(directory))
    if forward.read_bytes() != exported:
        raise RuntimeError(f"{forward} changed after export")
    if options.get("patch"):
        for f in ("training_model.onnx", "eval_model.onnx"):
            zero_dropout_ratios(directory / f)
    train_path, eval_path, opt_path = (directory / f for f in ("training_model.onnx", "eval_model.onnx",
                                                               "optimizer_model.onnx"))
    train_model = onnx.load(train_path)
    inputs = {vi.name: vi for vi in train_model.graph.input}
    # the loss block names its target input after the loss ("labels", "target"): the second input
    label_name = train_model.graph.input[1].name
    label_dtype = _np_type(inputs[label_name])
    rng = np.random.default_rng(seed)
    data = x.numpy() if "vocab" in options else x.numpy().astype(np.float32)
    if label_kind == "class":
        labels = rng.integers(0, classes, size=in_shape[0]).astype(label_dtype)
    elif label_kind == "binary":
        labels = rng.integers(0, 2, size=(in_shape[0], classes)).astype(label_dtype)
    else:
        labels = rng.standard_normal((in_shape[0], classes)).astype(label_dtype)
    np.savez_compressed(directory / "data.npz", input=data, labels=labels)  # labels feed `label_name`

    # the training API: one step, one optimizer step, then a 20-step curve
    state = CheckpointState.load_checkpoint(str(directory / "checkpoint"))
    buffers = [n for n in inputs if n.endswith("_grad.accumulation.buffer")]
    trainable = [n[: -len("_grad.accumulation.buffer")] for n in buffers]
    params = [n for n in inputs if n in requires_grad or n in frozen]
    initial = {p: np.array(state.parameters[p].data) for p in params}
    np.savez_compressed(directory / "initial_params.npz", **initial)
    # no eval model: generate_artifacts turns a training-mode BatchNormalization's training_mode off in
    # eval_model.onnx but keeps its three outputs, which onnxruntime then refuses to load
    module = Module(str(train_path), state, device="cpu")
    optimizer = Optimizer(str(opt_path), module)
    lr = float(optimizer.get_learning_rate())
    module.train()
    loss1 = module(data, labels)
    grads = {p: np.array(state.parameters[p].grad) for p in trainable}
    np.savez_compressed(directory / "api_step1.npz", loss=np.asarray(loss1, np.float32),
                        **{f"grad.{p}": g for p, g in grads.items()})
    optimizer.step()
    np.savez_compressed(directory / "api_optimizer_step1.npz",
                        **{f"param.{p}": np.array(state.parameters[p].data) for p in params})
    module.lazy_reset_grad()
    curve = [float(loss1)]
    for _ in range(STEPS - 1):
        curve.append(float(module(data, labels)))
        optimizer.step()
        module.lazy_reset_grad()
    (directory / "api_curve.json").write_text(json.dumps(
        {"learning_rate": lr, "steps": STEPS, "loss": curve,
         "procedure": "each step: module(input, labels); optimizer.step(); module.lazy_reset_grad() "
                      "- the same batch (data.npz) every step, starting from initial_params.npz"}, indent=1) + "\n")

    # the raw graphs, explicit inputs: what a lowered graph on plain onnxruntime must reproduce
    zero_buffers = {b: np.zeros_like(initial[b[: -len(BUFFER)]]) for b in buffers}
    raw_train = _run_training_model(train_model, data, label_name, labels, initial, zero_buffers)
    np.savez_compressed(directory / "raw_train_step1.npz", **raw_train)
    opt_model = onnx.load(opt_path)
    zero_moments = [np.zeros_like(initial[p]) for p in trainable]
    raw_opt = _run_optimizer_model(opt_model, lr, 1, [initial[p] for p in trainable],
                                   [raw_train[f"{b}.updated"] for b in buffers], zero_moments, zero_moments)
    np.savez_compressed(directory / "raw_optimizer_step1.npz", **raw_opt)
    raw_curve = _raw_curve(train_model, opt_model, data, label_name, labels, initial, trainable, buffers, lr)
    gap = float(np.max(np.abs(np.array(raw_curve) - np.array(curve))))
    (directory / "raw_curve.json").write_text(json.dumps(
        {"steps": STEPS, "loss": raw_curve, "max_abs_difference_to_api_curve": gap,
         "procedure": "step k = 1..20: training_model.onnx on the current parameters, the previous buffers "
                      "and lazy_reset_grad=[True]; then optimizer_model.onnx with step=[k], the buffers as "
                      "gradients and the moments carried over (zero at k = 1)"}, indent=1) + "\n")

    meta = {"name": name, "model": repr(model), "labels_input": label_name,
            "input_shape": list(in_shape), "labels_dtype": str(label_dtype),
            "loss": loss.name, "optimizer": optim.name, "learning_rate": lr, "seed": seed,
            "trainable_params": trainable, "frozen_params": [p for p in params if p not in trainable],
            "accumulation_buffers": buffers,
            "non_standard_ops": {f: non_standard_ops(directory / f) for f in
                                 ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx")},
            "opset_imports": {f: {o.domain or "ai.onnx": o.version for o in onnx.load(directory / f).opset_import}
                              for f in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx")},
            "ir_version": {f: onnx.load(directory / f).ir_version for f in
                           ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx")}}
    (directory / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    # last: torch's exporter numbers values per process, and this must not shift a later artifact's names
    truth = torch_f64_step(model, loss, data, labels, dict(np.load(directory / "initial_params.npz")), trainable)
    np.savez_compressed(directory / "torch_f64_step1.npz", **truth)
    agreement = _agreement(truth, loss1, grads)
    print(f"  artifact {name}: loss {curve[0]:.6f} -> {curve[-1]:.6f}; api_step1 vs torch f64: "
          f"loss {agreement['loss']:.1e}, gradients {agreement['gradients']:.1e}")
    return meta


def torch_f64_step(model: nn.Module, loss: artifacts.LossType, data: np.ndarray, labels: np.ndarray,
                   initial: dict[str, np.ndarray], trainable: list[str]) -> dict[str, np.ndarray]:
    """torch_f64_step1.npz's arrays: ``loss`` and ``grad.<param>`` (float64) of one train-mode step of a float64
    deep copy of ``model`` holding ``initial`` (by ONNX initializer name = torch state_dict key), with every
    dropout probability 0, on (data, labels), with generate_artifacts' ``loss`` (reduction mean)."""
    model = copy.deepcopy(model).double()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(module, nn.MultiheadAttention):  # a float, not an nn.Dropout
            module.dropout = 0.0
    model.train()  # BatchNorm on the batch's statistics
    params, state = dict(model.named_parameters()), model.state_dict(keep_vars=True)
    unmapped = sorted(set(initial) - set(state))
    if unmapped:
        raise RuntimeError(f"initializers with no torch tensor of that name: {unmapped}")
    if set(params) != set(trainable):
        raise RuntimeError(f"torch parameters {sorted(params)} != trainable initializers {sorted(trainable)}")
    with torch.no_grad():
        for name, value in initial.items():
            if tuple(state[name].shape) != value.shape:
                raise RuntimeError(f"{name}: torch shape {tuple(state[name].shape)} != initializer {value.shape}")
            state[name].copy_(torch.from_numpy(value))  # float32 -> float64: exact
    x = torch.from_numpy(data)
    output = model(x.double() if x.is_floating_point() else x)
    target = torch.from_numpy(labels)
    if loss == artifacts.LossType.CrossEntropyLoss:
        value = nn.functional.cross_entropy(output, target)
    elif loss == artifacts.LossType.MSELoss:
        value = nn.functional.mse_loss(output, target.double())
    elif loss == artifacts.LossType.BCEWithLogitsLoss:
        value = nn.functional.binary_cross_entropy_with_logits(output, target.double())
    elif loss == artifacts.LossType.L1Loss:
        value = nn.functional.l1_loss(output, target.double())
    else:
        raise NotImplementedError(loss)
    value.backward()
    missing = [p for p in trainable if params[p].grad is None]
    if missing:
        raise RuntimeError(f"no gradient for {missing}")
    arrays = {"loss": value.detach().numpy().astype(np.float64)}
    for p in trainable:
        grad = params[p].grad.numpy()
        if grad.dtype != np.float64 or grad.shape != initial[p].shape:
            raise RuntimeError(f"{p}: gradient {grad.dtype} {grad.shape}, parameter {initial[p].shape}")
        arrays[f"grad.{p}"] = grad
    return arrays


def _agreement(truth: dict, loss1, grads: dict) -> dict[str, float]:
    """The training API's first step against the float64 truth: |loss difference| / |loss| and
    max |api grad - torch grad| over every parameter / max |torch grad| over every parameter."""
    largest = max(float(np.abs(truth[f"grad.{p}"]).max()) for p in grads)
    gap = max(float(np.abs(g.astype(np.float64) - truth[f"grad.{p}"]).max()) for p, g in grads.items())
    return {"loss": abs(float(loss1) - float(truth["loss"])) / abs(float(truth["loss"])), "gradients": gap / largest}


def _expose(model: onnx.ModelProto, op_type: str, position_to_name) -> onnx.ModelProto:
    """A copy whose ``op_type`` nodes also produce their optional in-place outputs as graph outputs."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for node in model.graph.node:
        if node.op_type != op_type:
            continue
        for position, name in position_to_name(node).items():
            while len(node.output) <= position:
                node.output.append("")
            if node.output[position]:  # a named output no node reads: drop its old declaration
                _drop_value_info(model.graph, node.output[position])
            node.output[position] = name
            model.graph.output.append(helper.make_value_info(name, onnx.TypeProto()))
    return model


def _drop_value_info(graph: onnx.GraphProto, name: str) -> None:
    kept = [vi for vi in graph.value_info if vi.name != name]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _run_training_model(model, data, label_name, labels, params, buffers) -> dict:
    # InPlaceAccumulatorV2's optional second output is the updated buffer: name it <buffer>.updated
    exposed = _expose(model, "InPlaceAccumulatorV2", lambda n: {1: f"{n.input[0]}.updated"})
    # BatchNormInternal's running statistics: no graph output reads them, yet the training API's kernel
    # writes them into its running_mean/running_var inputs in place; expose them the same way
    exposed = _expose(exposed, "BatchNormInternal", lambda n: {1: f"{n.input[3]}.updated", 2: f"{n.input[4]}.updated"})
    feeds = {"input": data, label_name: labels, "lazy_reset_grad": np.array([True])}
    feeds.update({vi.name: params[vi.name] for vi in model.graph.input if vi.name in params})
    feeds.update(buffers)
    feeds = {k: np.array(v, copy=True) for k, v in feeds.items()}  # in-place kernels write into feeds
    session = _session(exposed)
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, feeds), strict=True))
    return {k: np.asarray(v) for k, v in out.items()}


def _run_optimizer_model(model, lr, step, params, grads, moments_1, moments_2) -> dict:
    optimizer_ops = {"AdamWOptimizer": {1: "params.updated", 2: "first_order_moments.updated",
                                        3: "second_order_moments.updated"},
                     "SGDOptimizerV2": {1: "params.updated"}}
    for op_type, outs in optimizer_ops.items():
        model = _expose(model, op_type, lambda n, outs=outs: outs)
    feeds = {"learning_rate": np.array([lr], np.float32), "step": np.array([step], np.int64),
             "params": list(params), "gradients": list(grads), "first_order_moments": list(moments_1),
             "second_order_moments": list(moments_2)}
    names = {vi.name for vi in model.graph.input}
    # copies: the in-place kernels write into the fed arrays' memory (the first version of this
    # harness fed one zero list as both moments and got them clobbered)
    feeds = {k: [np.array(t, copy=True) for t in v] if isinstance(v, list) else np.array(v, copy=True)
             for k, v in feeds.items() if k in names}
    session = _session(model)
    arrays = {}
    # the sequence inputs are initial_params.npz and raw_train_step1.npz's buffers (or zeros): not stored again
    for name in ("learning_rate", "step"):
        arrays[f"in.{name}"] = feeds[name]
    for meta, value in zip(session.get_outputs(), session.run(None, feeds), strict=True):
        _store(arrays, meta.name, value)
    return arrays


def _raw_curve(train_model, opt_model, data, label_name, labels, initial, trainable, buffers, lr) -> list[float]:
    """The 20-step loop on the raw graphs, carrying parameters, buffers and moments by hand."""
    params = dict(initial)
    grads = {b: np.zeros_like(initial[b[: -len(BUFFER)]]) for b in buffers}
    moments_1 = moments_2 = [np.zeros_like(initial[p]) for p in trainable]
    loss_name = train_model.graph.output[0].name
    losses = []
    for step in range(1, STEPS + 1):
        out = _run_training_model(train_model, data, label_name, labels, params, grads)
        losses.append(float(out[loss_name]))
        grads = {b: out[f"{b}.updated"] for b in buffers}
        opt = _run_optimizer_model(opt_model, lr, step, [params[p] for p in trainable],
                                   [grads[b] for b in buffers], moments_1, moments_2)
        params.update({p: opt[f"params.updated.{i}"] for i, p in enumerate(trainable)})
        if f"first_order_moments.updated.{0}" in opt:
            moments_1 = [opt[f"first_order_moments.updated.{i}"] for i in range(len(trainable))]
            moments_2 = [opt[f"second_order_moments.updated.{i}"] for i in range(len(trainable))]
    return losses


def _store(arrays: dict, key: str, value) -> None:
    if isinstance(value, list):
        for i, item in enumerate(value):
            arrays[f"{key}.{i}"] = np.asarray(item)
    else:
        arrays[key] = np.asarray(value)


# the first five artifacts keep the seeds they were recorded with (their order in ARTIFACTS); every later
# one is seeded from its name, so artifacts added side by side (on separate branches) never shift each other
FIRST_SEEDS = {"cnn": 1, "mlp": 2, "mlp_bce": 3, "mlp_l1": 4, "cnn1d": 5}


def seed_of(name: str) -> int:
    return FIRST_SEEDS.get(name, zlib.crc32(name.encode()) % 10_000 + 100)


def main(out_root: Path, only: list[str] | None = None) -> None:
    """Record every artifact, or just ``only`` (the others' directories and inventory entries are kept).

    torch's exporter numbers values per process, so an artifact's value names depend on what was exported
    before it in the same process: the first five were recorded together, every later one alone
    (``make_fixtures.py --artifact NAME``), which is how each reproduces byte for byte."""
    out_root.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(only or ()) - set(ARTIFACTS))
    if unknown:
        raise SystemExit(f"unknown artifact(s) {unknown}; known: {sorted(ARTIFACTS)}")
    index = out_root / "inventory.json"
    inventory = json.loads(index.read_text()) if only and index.exists() else {}
    for name in only or ARTIFACTS:
        inventory[name] = make(name, out_root, seed_of(name))["non_standard_ops"]
    index.write_text(json.dumps(dict(sorted(inventory.items())), indent=1) + "\n")
