"""A held-out sweep for the artifact generator: models the project's fixtures never saw, and onnxruntime-training's
own step on each (the reference oplower's ``generate_artifacts`` must reproduce).

    /work/ortt-venv/bin/python tools/ort_training/heldout_sweep.py [--out /tmp/heldout] [NAME ...]
    /work/ortt-venv/bin/python tools/ort_training/heldout_sweep.py --run-ours /tmp/heldout/NAME   # JSON on stdout
    /work/venv/bin/python tools/heldout_check.py [--root /tmp/heldout] [NAME ...]                 # oplower's side

Never imports oplower (onnxruntime-training and plain onnxruntime cannot share a venv). Each model is built in
torch (small sizes, written here: torchvision is not installable) as users write them -- MobileNetV3, EfficientNet,
ShuffleNet, RegNet, ConvNeXt, ResNet blocks, a UNet, nn.TransformerEncoder with padding / causal masks, GPT-2,
ViT, T5 blocks, LSTM / GRU / RNN classifiers, a 1-D audio net, MLPs with many activations, an in-model NLL loss,
symbolic batch dimensions -- or hand-built with onnx.helper (each with a torch mirror for its float64 truth),
exported with ``torch.onnx.export(opset_version=17, training=TrainingMode.TRAINING, do_constant_folding=False,
dynamo=False)``. Per model, ``OUT/<name>/``:

- ``forward_model.onnx``: the export, unpatched (LayerNormalization with Y only, attention Dropout without a
  mask), every Dropout's ratio 0 (a new initializer, as tests/test_artifacts.py's zero_dropout): the input of
  oplower's generator;
- ``data.npz``: the batch, keyed by the training model's user input names (``meta.json``'s ``inputs``, in order);
- ``initial_params.npz``: every parameter (trainable and frozen) by initializer name;
- ``reference.npz``: the step oplower must reproduce: ``loss``, ``grad.<p>`` per trainable parameter,
  ``param.<p>`` after the first optimizer step (frozen ones too where known). ``meta.json``'s ``truth`` says whose:
  ``onnxruntime-training`` (generate_artifacts on a patched copy of the export -- LayerNormalization's Mean /
  InvStdDev outputs, every Dropout's mask, make_artifacts.patch_forward -- with the export's own Dropout ratios,
  then every Dropout/DropoutGrad ratio set to 0 in the generated models, make_artifacts.zero_dropout_ratios; one
  ``Module`` step and one ``Optimizer`` step from its checkpoint) or, where onnxruntime-training's generator or
  runtime fails on the model or its gradients err more than 1e-4 of the largest entry against float64 torch,
  ``torch-f64`` (torch autograd on a float64 copy, dropout 0, train mode; the optimizer step computed in float64
  with onnxruntime-training's AdamW / SGD formulas, batch norm's running statistics as its BatchNormInternal
  updates them: momentum 0.9, the batch's biased variance -- both formulas checked against its own steps, within
  6e-8 and 1.2e-7);
- ``torch_f64.npz``: the float64 truth (``loss``, ``grad.<p>``), for every model;
- ``meta.json``: the model's description, its ops, the generate_artifacts arguments (trainable_params = the torch
  parameters, frozen_params = every other initializer, as onnxruntime's tutorials do; loss, optimizer), the
  learning rate, the inputs in Module order, ``ort_failure`` (onnxruntime-training's error or wrong gradients, a
  finding: oplower must not share it), onnxruntime-training's gradients against the float64 truth.

``--run-ours DIR`` loads oplower's artifacts written by tools/heldout_check.py into ``DIR/oplower/`` in
onnxruntime-training's own runtime (CheckpointState, Module, Optimizer), takes one step and one optimizer step
from ``initial_params.npz`` and prints the errors against ``reference.npz`` as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import traceback
import zlib
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F  # noqa: N812
from onnx import helper, numpy_helper
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_artifacts import (  # noqa: E402
    patch_forward,
    perturb_constant_parameters,
    randomize_batch_norm,
    zero_dropout_ratios,
)

BUFFER = "_grad.accumulation.buffer"
LOSS_RTOL, ARRAY_TOL = 1e-5, 1e-4
ADAMW = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-6, "weight_decay": 0.0}  # generate_artifacts' AdamW attributes
DEFAULT_LR = 0.0010000000474974513  # onnxruntime-training's Optimizer default (float32 1e-3)


# ================================================================= CNNs ==============================================

class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int, act=nn.ReLU, gate=nn.Hardsigmoid):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)
        self.act, self.gate = act(), gate()

    def forward(self, x):
        return x * self.gate(self.fc2(self.act(self.fc1(self.pool(x)))))


def conv_bn(cin, cout, k, stride=1, groups=1, act=nn.ReLU):
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, act()) if act is not None else nn.Sequential(*layers)


class MBConv(nn.Module):
    """MobileNetV3 / EfficientNet inverted residual: expand, depthwise, squeeze-excitation, project."""

    def __init__(self, cin, mid, cout, k, stride, act, se_act, se_gate):
        super().__init__()
        self.expand = conv_bn(cin, mid, 1, act=act)
        self.dw = conv_bn(mid, mid, k, stride, groups=mid, act=act)
        self.se = SqueezeExcite(mid, max(2, mid // 4), se_act, se_gate)
        self.project = conv_bn(mid, cout, 1, act=None)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.project(self.se(self.dw(self.expand(x))))
        return x + y if self.residual else y


def mobilenetv3():
    return nn.Sequential(
        conv_bn(3, 8, 3, 2, act=nn.Hardswish),
        MBConv(8, 16, 8, 3, 1, nn.Hardswish, nn.ReLU, nn.Hardsigmoid),
        MBConv(8, 24, 12, 5, 2, nn.Hardswish, nn.ReLU, nn.Hardsigmoid),
        conv_bn(12, 24, 1, act=nn.Hardswish), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(24, 16), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(16, 5))


def efficientnet():
    return nn.Sequential(
        conv_bn(3, 8, 3, 2, act=nn.SiLU),
        MBConv(8, 16, 8, 3, 1, nn.SiLU, nn.SiLU, nn.Sigmoid),
        MBConv(8, 32, 12, 3, 2, nn.SiLU, nn.SiLU, nn.Sigmoid),
        conv_bn(12, 24, 1, act=nn.SiLU), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(24, 4))


def channel_shuffle(x, groups):
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)


class ShuffleUnit(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        half = cout // 2
        self.stride = stride
        if stride > 1:
            self.branch1 = nn.Sequential(nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False),
                                         nn.BatchNorm2d(cin), nn.Conv2d(cin, half, 1, bias=False),
                                         nn.BatchNorm2d(half), nn.ReLU())
        inner = cin if stride > 1 else half
        self.branch2 = nn.Sequential(nn.Conv2d(inner, half, 1, bias=False), nn.BatchNorm2d(half), nn.ReLU(),
                                     nn.Conv2d(half, half, 3, stride, 1, groups=half, bias=False),
                                     nn.BatchNorm2d(half), nn.Conv2d(half, half, 1, bias=False),
                                     nn.BatchNorm2d(half), nn.ReLU())

    def forward(self, x):
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


def shufflenet():
    return nn.Sequential(conv_bn(3, 8, 3, 1), nn.MaxPool2d(3, 2, 1), ShuffleUnit(8, 16, 2), ShuffleUnit(16, 16, 1),
                         nn.Conv2d(16, 24, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 4))


class RegNetBlock(nn.Module):
    """RegNetY: 1x1, grouped 3x3 (group width 4), squeeze-excitation, 1x1, projected shortcut."""

    def __init__(self, cin, cout, stride, group_width=4):
        super().__init__()
        self.a = conv_bn(cin, cout, 1)
        self.b = conv_bn(cout, cout, 3, stride, groups=cout // group_width)
        self.se = SqueezeExcite(cout, max(2, cin // 4), nn.ReLU, nn.Sigmoid)
        self.c = conv_bn(cout, cout, 1, act=None)
        self.proj = conv_bn(cin, cout, 1, stride, act=None) if stride > 1 or cin != cout else None
        self.relu = nn.ReLU()

    def forward(self, x):
        shortcut = self.proj(x) if self.proj is not None else x
        return self.relu(self.c(self.se(self.b(self.a(x)))) + shortcut)


def regnet():
    return nn.Sequential(conv_bn(3, 8, 3, 2), RegNetBlock(8, 16, 2), RegNetBlock(16, 16, 1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))


class LayerNorm2d(nn.Module):
    """ConvNeXt's channels-first LayerNorm, written out (ReduceMean, Pow, Sqrt, Div)."""

    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c)), eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1, self.act, self.pw2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.gamma * self.pw2(self.act(self.pw1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 2, stride=2), LayerNorm2d(8))
        self.block1 = ConvNeXtBlock(8)
        self.down = nn.Sequential(LayerNorm2d(8), nn.Conv2d(8, 16, 2, stride=2))
        self.block2 = ConvNeXtBlock(16)
        self.norm = nn.LayerNorm(16, eps=1e-6)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.block2(self.down(self.block1(self.stem(x))))
        return self.head(self.norm(x.mean([-2, -1])))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1, self.c2 = conv_bn(cin, cout, 3, stride), conv_bn(cout, cout, 3, act=None)
        self.down = conv_bn(cin, cout, 1, stride, act=None) if stride > 1 or cin != cout else None

    def forward(self, x):
        return torch.relu(self.c2(self.c1(x)) + (x if self.down is None else self.down(x)))


class Bottleneck(nn.Module):
    def __init__(self, cin, width, cout, stride):
        super().__init__()
        self.c1, self.c2 = conv_bn(cin, width, 1), conv_bn(width, width, 3, stride)
        self.c3 = conv_bn(width, cout, 1, act=None)
        self.down = conv_bn(cin, cout, 1, stride, act=None) if stride > 1 or cin != cout else None

    def forward(self, x):
        return F.relu(self.c3(self.c2(self.c1(x))) + (x if self.down is None else self.down(x)))


def resnet_basic():
    return nn.Sequential(conv_bn(3, 8, 3), nn.MaxPool2d(2), BasicBlock(8, 8, 1), BasicBlock(8, 16, 2),
                         nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1), nn.Linear(16, 4))


def resnet_bottleneck():
    return nn.Sequential(conv_bn(3, 8, 3, 2), Bottleneck(8, 4, 16, 1), Bottleneck(16, 4, 16, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3))


class UNet(nn.Module):
    """Two levels: the deeper one comes back by ConvTranspose (stride 2), the other by nn.Upsample (bilinear or
    nearest, a Resize), each concatenated with its skip."""

    def __init__(self, mode="bilinear", classes=2):
        super().__init__()
        self.enc1 = conv_bn(3, 4, 3)
        self.enc2 = conv_bn(4, 8, 3)
        self.enc3 = conv_bn(8, 8, 3)
        self.pool = nn.MaxPool2d(2)
        self.up3 = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.dec2 = conv_bn(16, 8, 3)
        self.up2 = nn.Upsample(scale_factor=2, mode=mode, **({"align_corners": False} if mode == "bilinear" else {}))
        self.dec1 = conv_bn(12, 4, 3)
        self.out = nn.Conv2d(4, classes, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        e3 = self.enc3(self.pool(e2))
        d2 = self.dec2(torch.cat([self.up3(e3), e2], 1))
        d1 = self.dec1(torch.cat([self.up2(d2), e1], 1))
        return self.out(d1)


def unet():
    return UNet("bilinear")


def unet_nearest():
    return UNet("nearest", classes=3)


class AudioNet(nn.Module):
    """1-D conv audio classifier: strided/dilated Conv1d, BatchNorm1d, GroupNorm, InstanceNorm1d, pooling."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn1 = nn.Conv1d(1, 4, 9, stride=2, padding=4), nn.BatchNorm1d(4)
        self.c2, self.gn = nn.Conv1d(4, 8, 5, stride=2, padding=2), nn.GroupNorm(2, 8)
        self.pool = nn.MaxPool1d(2)
        self.c3, self.inorm = nn.Conv1d(8, 8, 3, padding=2, dilation=2), nn.InstanceNorm1d(8, affine=True)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.bn1(self.c1(x)))
        x = self.pool(F.relu(self.gn(self.c2(x))))
        x = F.gelu(self.inorm(self.c3(x)))
        return self.head(F.adaptive_avg_pool1d(x, 1).flatten(1))


class NormNet(nn.Module):
    """InstanceNorm2d (affine), GroupNorm, ELU, AvgPool; a symbolic batch dimension."""

    def __init__(self):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(3, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True)
        self.c2, self.n2 = nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.GroupNorm(4, 8)
        self.head = nn.Linear(8 * 2 * 2, 3)

    def forward(self, x):
        x = F.elu(self.n1(self.c1(x)))
        x = F.avg_pool2d(F.leaky_relu(self.n2(self.c2(x)), 0.2), 2)
        return self.head(x.flatten(1))


def cnn_dynamic():
    return nn.Sequential(conv_bn(3, 8, 3), nn.MaxPool2d(2), conv_bn(8, 8, 3, groups=2, act=nn.ReLU6),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


# ============================================================= transformers ==========================================

VOCAB, SEQ, D, HEADS, FFN, PAD = 20, 8, 16, 2, 32, 0


class EncoderPadMask(nn.Module):
    """Embedding(padding_idx) + learned positions, nn.TransformerEncoder (2 layers, post-norm, ReLU) with
    src_key_padding_mask from the tokens, a masked mean pool, a classifier."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.pos = nn.Embedding(SEQ, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, FFN, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)

    def forward(self, tokens):
        pad = tokens == PAD
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        h = self.encoder(self.tok(tokens) + self.pos(positions), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


class EncoderCausal(nn.Module):
    """A language model: nn.TransformerEncoder (2 layers, norm_first, GELU) with a float causal mask, logits
    flattened to [batch*seq, vocab] for CrossEntropyLoss."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(0.1 * torch.randn(1, SEQ, D))
        layer = nn.TransformerEncoderLayer(D, HEADS, FFN, dropout=0.1, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens):
        t = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.encoder(self.tok(tokens) + self.pos[:, :t], mask=mask, is_causal=True)
        return self.head(h).reshape(-1, VOCAB)


def new_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class GptAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.attn_drop, self.resid_drop = nn.Dropout(0.1), nn.Dropout(0.1)
        self.register_buffer("bias", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(D, dim=2)
        q, k, v = (y.view(b, t, HEADS, c // HEADS).transpose(1, 2) for y in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.c_proj(y))


class GptBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = GptAttention()
        self.c_fc, self.c_proj, self.drop = nn.Linear(D, 4 * D), nn.Linear(4 * D, D), nn.Dropout(0.1)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.drop(self.c_proj(new_gelu(self.c_fc(self.ln_2(x)))))


class Gpt2(nn.Module):
    """GPT-2 (nanoGPT): wte + wpe, 2 pre-norm blocks with a tril buffer mask (masked_fill -> Where), the written-out
    tanh GELU (Pow), a final LayerNorm and an lm_head tied to wte; next-token logits flattened."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList([GptBlock(), GptBlock()])
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(0, idx.size(1), dtype=torch.long).unsqueeze(0)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)).view(-1, VOCAB)


class ViT(nn.Module):
    """Patch embedding (Conv 4x4 / 4 on 8x8), a cls token expanded to the (symbolic) batch, positions, two
    nn.TransformerEncoderLayer (norm_first, GELU), the cls token's head."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, D, 4, stride=4)
        self.cls = nn.Parameter(0.1 * torch.randn(1, 1, D))
        self.pos = nn.Parameter(0.1 * torch.randn(1, 5, D))
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(D, HEADS, FFN, 0.1, "gelu", batch_first=True,
                                                                norm_first=True) for _ in range(2)])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, image):
        x = self.patch(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)[:, 0])


class T5LayerNorm(nn.Module):
    """RMSNorm as T5 writes it out: Pow, ReduceMean, Sqrt, Div (no mean subtracted, no bias)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x / torch.sqrt(variance + self.eps))


class T5Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = T5LayerNorm(D), T5LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.wi, self.wo = nn.Linear(D, FFN, bias=False), nn.Linear(FFN, D, bias=False)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, bias):
        b, t, _ = x.shape
        h = self.ln1(x)

        def split(y):
            return y.view(b, t, HEADS, D // HEADS).transpose(1, 2)

        scores = split(self.q(h)) @ split(self.k(h)).transpose(-1, -2) + bias  # T5: no 1/sqrt(d)
        att = self.drop(F.softmax(scores.float(), dim=-1).type_as(scores))
        x = x + self.drop(self.o((att @ split(self.v(h))).transpose(1, 2).reshape(b, t, D)))
        return x + self.drop(self.wo(self.drop(F.relu(self.wi(self.ln2(x))))))


class T5Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.rel = nn.Parameter(0.1 * torch.randn(1, HEADS, SEQ, SEQ))  # a learned position bias
        self.blocks = nn.ModuleList([T5Block(), T5Block()])
        self.final = T5LayerNorm(D)
        self.head = nn.Linear(D, 3)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.rel)
        return self.head(self.final(x).mean(1))


class BertPad(nn.Module):
    """BERT embeddings (word with padding_idx, position, token type), LayerNorm, a hand-written attention with the
    extended additive mask (1 - mask) * -10000, a tanh pooler; multi-label head."""

    def __init__(self):
        super().__init__()
        self.word = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.position, self.token_type = nn.Embedding(SEQ, D), nn.Embedding(2, D)
        self.ln = nn.LayerNorm(D, eps=1e-12)
        self.qkv = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.out, self.ln2 = nn.Linear(D, D), nn.LayerNorm(D, eps=1e-12)
        self.ffn = nn.Sequential(nn.Linear(D, FFN), nn.GELU(), nn.Linear(FFN, D))
        self.ln3 = nn.LayerNorm(D, eps=1e-12)
        self.pooler = nn.Linear(D, D)
        self.drop = nn.Dropout(0.1)
        self.cls = nn.Linear(D, 4)

    def forward(self, tokens):
        b, t = tokens.shape
        mask = (tokens != PAD).to(torch.float32)
        ext = (1.0 - mask[:, None, None, :]) * -10000.0
        types = torch.zeros_like(tokens)
        types[:, t // 2:] = 1
        pos = torch.arange(t).unsqueeze(0).expand(b, t)
        x = self.drop(self.ln(self.word(tokens) + self.position(pos) + self.token_type(types)))
        q, k, v = (lin(x).view(b, t, HEADS, D // HEADS).permute(0, 2, 1, 3) for lin in self.qkv)
        att = self.drop(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D // HEADS) + ext, -1))
        x = self.ln2(x + self.drop(self.out((att @ v).permute(0, 2, 1, 3).reshape(b, t, D))))
        x = self.ln3(x + self.drop(self.ffn(x)))
        return self.cls(self.drop(torch.tanh(self.pooler(x[:, 0]))))


# =============================================================== recurrent ===========================================

class LstmBi2(nn.Module):
    """2-layer bidirectional LSTM, the last time step's output (a Gather) to a classifier."""

    def __init__(self):
        super().__init__()
        # inter-layer dropout cannot be exported in training mode (torch: "dropout in training mode")
        self.rnn = nn.LSTM(4, 6, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class GruEmbed(nn.Module):
    """Embedding -> bidirectional GRU; the two final hidden states concatenated (h[-2], h[-1])."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.rnn = nn.GRU(8, 8, bidirectional=True, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens):
        _, h = self.rnn(self.embed(tokens))
        return self.head(torch.cat([h[-2], h[-1]], dim=1))


class LstmTagger(nn.Module):
    """Sequence-first LSTM with an initial state from a learned parameter, a per-step regression head."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 6)
        self.h0 = nn.Parameter(0.1 * torch.randn(1, 1, 6))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        b = x.shape[1]
        h0 = self.h0.expand(1, b, 6).contiguous()
        out, _ = self.rnn(x, (h0, torch.zeros_like(h0)))
        return self.head(torch.tanh(out))


class ElmanRnn(nn.Module):
    """nn.RNN (tanh), 2 layers: ONNX RNN nodes."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(4, 6, num_layers=2, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        out, h = self.rnn(x)
        return self.head(out.mean(1) + h[-1])


class GruSensor(nn.Module):
    """A sensor window (batch first, 12 steps of 6 channels) through a GRU, the last step's state classified
    (added in session 32, measured only: a second recurrent family at batch 4)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(6, 8, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        _, h = self.rnn(x)
        return self.head(h[-1])


class LstmSensor(nn.Module):
    """A batch-first LSTM over 10 steps of 4 channels, its outputs averaged over time and classified (session 32,
    measured only)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out.mean(1))


# ==================================================================== MLPs ===========================================

def mlp_acts():
    return nn.Sequential(nn.Linear(6, 12), nn.ELU(), nn.Linear(12, 12), nn.GELU(approximate="tanh"),
                         nn.Linear(12, 12), nn.Softplus(beta=2.0), nn.Linear(12, 12), nn.Mish(),
                         nn.Linear(12, 12), nn.Hardtanh(-0.5, 0.5), nn.Linear(12, 12), nn.PReLU(12),
                         nn.Linear(12, 12), nn.PReLU(), nn.Linear(12, 3))


class MlpNll(nn.Module):
    """LogSoftmax and the NLL loss inside the model (loss=None): the model's output is the loss."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5),
                                 nn.LogSoftmax(dim=1))

    def forward(self, x, labels):
        return F.nll_loss(self.net(x), labels)


class MlpCeInModel(nn.Module):
    """cross_entropy inside the model (loss=None; label smoothing has no ONNX export)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.SiLU(), nn.Linear(16, 5))

    def forward(self, x, labels):
        return F.cross_entropy(self.net(x), labels)


class MlpNllSmooth(nn.Module):
    """LogSoftmax, a class-weighted NLL (a frozen weight buffer) summed, plus label smoothing written out
    (-mean of the log-probabilities): the model's output is the loss (loss=None)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 5), nn.LogSoftmax(dim=1))
        self.register_buffer("class_weight", torch.tensor([1.0, 2.0, 0.5, 1.5, 1.0]))

    def forward(self, x, labels):
        logp = self.net(x)
        return F.nll_loss(logp, labels, weight=self.class_weight, reduction="sum") / x.shape[0] - 0.1 * logp.mean()


class MlpNllLog(nn.Module):
    """Softmax, Log of the probabilities, NLL: torch exports NegativeLogLikelihoodLoss (loss=None)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))

    def forward(self, x, labels):
        return F.nll_loss(torch.log(F.softmax(self.net(x), dim=1) + 1e-6), labels)


class EncoderMaskInput(nn.Module):
    """nn.TransformerEncoder (2 layers, GELU) with src_key_padding_mask given as a second (bool) model input, a
    symbolic batch and sequence length; the first token's head."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.pos = nn.Parameter(0.1 * torch.randn(1, SEQ, D))
        layer = nn.TransformerEncoderLayer(D, HEADS, FFN, dropout=0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)

    def forward(self, tokens, pad_mask):
        h = self.tok(tokens) + self.pos[:, : tokens.shape[1]]
        return self.head(self.encoder(h, src_key_padding_mask=pad_mask)[:, 0])


class AudioDynamic(nn.Module):
    """1-D audio net over a symbolic batch and length: Conv1d, GroupNorm, MaxPool1d, AvgPool1d, a dilated Conv1d,
    the mean over time."""

    def __init__(self):
        super().__init__()
        self.c1, self.gn = nn.Conv1d(2, 8, 5, stride=2, padding=2), nn.GroupNorm(2, 8)
        self.c2 = nn.Conv1d(8, 8, 3, padding=2, dilation=2)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = F.max_pool1d(F.silu(self.gn(self.c1(x))), 2)
        x = F.avg_pool1d(F.relu(self.c2(x)), 2, ceil_mode=True)
        return self.head(x.mean(-1))


def mlp_dyn_bce():
    return nn.Sequential(nn.Linear(6, 16), nn.SELU(), nn.Linear(16, 16), nn.Sigmoid(), nn.Linear(16, 4))


def mlp_dyn_l1():
    return nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.05), nn.Linear(16, 16), nn.Softsign(), nn.Linear(16, 16),
                         nn.CELU(0.7), nn.LayerNorm(16), nn.Linear(16, 2))


# ================================================================ hand-built =========================================

def _w(gen, *shape, scale=0.4):
    return (scale * torch.randn(*shape, generator=gen)).numpy().astype(np.float32)


class HandBuilt:
    """A forward graph written with onnx.helper and a torch function computing the same in float64 (the truth)."""

    def __init__(self, graph_fn, torch_fn):
        self.graph_fn, self.torch_fn = graph_fn, torch_fn


def hand_gemm_graph(gen):
    """Gemm transB alpha/beta, MatMul, Tanh, Sigmoid, Mul by the input, ReduceSum with keepdims, Div, Sqrt,
    Softmax on axis 0, Exp, Log, Neg, Abs; opset 17, symbolic batch."""
    p = {"W1": _w(gen, 5, 6), "B1": _w(gen, 6), "W2": _w(gen, 4, 6), "C2": _w(gen, 4), "S": _w(gen, 1, 4) + 1.5}
    nodes = [
        helper.make_node("MatMul", ["input", "W1"], ["m1"]), helper.make_node("Add", ["m1", "B1"], ["a1"]),
        helper.make_node("Tanh", ["a1"], ["t1"]),
        helper.make_node("Gemm", ["t1", "W2", "C2"], ["g2"], transB=1, alpha=0.5, beta=2.0),
        helper.make_node("Sigmoid", ["g2"], ["s2"]), helper.make_node("Mul", ["s2", "S"], ["m2"]),
        helper.make_node("ReduceSum", ["m2", "ax1"], ["r2"], keepdims=1),
        helper.make_node("Sqrt", ["r2"], ["q2"]), helper.make_node("Div", ["m2", "q2"], ["d2"]),
        helper.make_node("Softmax", ["d2"], ["sm"], axis=0), helper.make_node("Exp", ["g2"], ["e2"]),
        helper.make_node("Add", ["e2", "one"], ["e3"]), helper.make_node("Log", ["e3"], ["l2"]),
        helper.make_node("Neg", ["l2"], ["n2"]), helper.make_node("Abs", ["g2"], ["ab"]),
        helper.make_node("Sum", ["sm", "n2", "ab"], ["output"]),
    ]
    consts = [numpy_helper.from_array(np.array([1], np.int64), "ax1"),
              numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    return nodes, p, consts, {"input": ["batch", 5]}, {"output": ["batch", 4]}


def hand_gemm_torch(p, x):
    t1 = torch.tanh(x @ p["W1"] + p["B1"])
    g2 = 0.5 * (t1 @ p["W2"].T) + 2.0 * p["C2"]
    m2 = torch.sigmoid(g2) * p["S"]
    d2 = m2 / torch.sqrt(m2.sum(1, keepdim=True))
    return torch.softmax(d2, 0) - torch.log(torch.exp(g2) + 1.0) + g2.abs()


def hand_conv_graph(gen):
    """Conv with auto_pad SAME_UPPER and stride 2, Relu, MaxPool, ConvTranspose (output_padding 1, bias),
    Resize nearest by sizes, Concat, GlobalAveragePool, Flatten, Gemm transB."""
    p = {"Wc": _w(gen, 4, 3, 3, 3), "Bc": _w(gen, 4), "Wt": _w(gen, 4, 3, 3, 3), "Bt": _w(gen, 3),
         "Wf": _w(gen, 4, 7), "Bf": _w(gen, 4)}
    nodes = [
        helper.make_node("Conv", ["input", "Wc", "Bc"], ["c1"], auto_pad="SAME_UPPER", strides=[2, 2],
                         kernel_shape=[3, 3]),                                       # 9x9 -> 5x5
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("ConvTranspose", ["r1", "Wt", "Bt"], ["t1"], strides=[2, 2], pads=[1, 1, 1, 1],
                         output_padding=[1, 1]),                                      # 5x5 -> 10x10
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[1, 1]),  # 5x5 -> 4x4
        helper.make_node("Resize", ["p1", "", "", "sizes"], ["u1"], mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),  # -> 10x10
        helper.make_node("Concat", ["t1", "u1"], ["cat"], axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["fl"]),
        helper.make_node("Gemm", ["fl", "Wf", "Bf"], ["output"], transB=1),
    ]
    consts = [numpy_helper.from_array(np.array([3, 4, 10, 10], np.int64), "sizes")]
    return nodes, p, consts, {"input": [3, 3, 9, 9]}, {"output": [3, 4]}


def hand_conv_torch(p, x):
    c1 = F.conv2d(F.pad(x, (1, 1, 1, 1)), p["Wc"], p["Bc"], stride=2)
    r1 = F.relu(c1)
    t1 = F.conv_transpose2d(r1, p["Wt"], p["Bt"], stride=2, padding=1, output_padding=1)
    p1 = F.max_pool2d(r1, 2, 1)
    idx = torch.floor(torch.arange(10) * (4 / 10)).long()  # asymmetric, floor: x_in = floor(x_out / scale)
    u1 = p1[:, :, idx][:, :, :, idx]
    cat = torch.cat([t1, u1], 1)
    return cat.mean((2, 3)) @ p["Wf"].T + p["Bf"]


def hand_resize_graph(gen):
    """Resize linear (half_pixel, by scales), Resize cubic (align_corners), InstanceNormalization, Pad (reflect),
    AveragePool, opset 17."""
    p = {"Wc": _w(gen, 3, 2, 3, 3), "Sc": _w(gen, 3) + 1.0, "Bi": _w(gen, 3), "Wf": _w(gen, 3, 2)}
    nodes = [
        helper.make_node("Resize", ["input", "", "scales"], ["u1"], mode="linear",
                         coordinate_transformation_mode="half_pixel"),                # 5x5 -> 10x10
        helper.make_node("Conv", ["u1", "Wc"], ["c1"], kernel_shape=[3, 3]),          # -> 8x8
        helper.make_node("InstanceNormalization", ["c1", "Sc", "Bi"], ["n1"], epsilon=1e-5),
        helper.make_node("Tanh", ["n1"], ["a1"]),
        helper.make_node("Resize", ["a1", "", "", "sizes"], ["u2"], mode="cubic",
                         coordinate_transformation_mode="align_corners", cubic_coeff_a=-0.75),  # -> 5x6
        helper.make_node("Pad", ["u2", "pads"], ["pd"], mode="reflect"),              # -> 7x8
        helper.make_node("AveragePool", ["pd"], ["ap"], kernel_shape=[7, 8]),
        helper.make_node("Flatten", ["ap"], ["fl"]),
        helper.make_node("MatMul", ["fl", "Wf"], ["output"]),
    ]
    consts = [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
              numpy_helper.from_array(np.array([2, 3, 5, 6], np.int64), "sizes"),
              numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads")]
    return nodes, p, consts, {"input": [2, 2, 5, 5]}, {"output": [2, 2]}


def hand_resize_torch(p, x):
    u1 = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
    c1 = F.conv2d(u1, p["Wc"])
    n1 = F.instance_norm(c1, weight=p["Sc"], bias=p["Bi"], eps=1e-5)
    u2 = F.interpolate(torch.tanh(n1), size=(5, 6), mode="bicubic", align_corners=True)
    pd = F.pad(u2, (1, 1, 1, 1), mode="reflect")
    return pd.mean((2, 3)) @ p["Wf"]


HAND = {"hand_gemm": HandBuilt(hand_gemm_graph, hand_gemm_torch),
        "hand_conv": HandBuilt(hand_conv_graph, hand_conv_torch),
        "hand_resize": HandBuilt(hand_resize_graph, hand_resize_torch)}


# ================================================================ the sweep ==========================================

# name: (factory, input kind and shape, (labels kind, classes), loss, optimizer, options)
# input kinds: "real" (randn), "tokens" (ids below VOCAB; PAD tails where "pad"), "hand" (a HandBuilt graph)
# labels kinds: "class" [batch], "class_flat" [batch*seq], "real"/"binary" like the output; "none": the model's
# forward takes (input, labels) and returns the loss (loss=None)
# options: dynamic (the batch axis symbolic), pad (token tails set to PAD)
SPECS = {
    "mobilenetv3": (mobilenetv3, ("real", (4, 3, 16, 16)), ("class", 5), "CrossEntropyLoss", "AdamW", {}),
    "efficientnet": (efficientnet, ("real", (4, 3, 16, 16)), ("class", 4), "CrossEntropyLoss", "AdamW", {}),
    "shufflenet": (shufflenet, ("real", (4, 3, 16, 16)), ("class", 4), "CrossEntropyLoss", "SGD", {}),
    "regnet": (regnet, ("real", (4, 3, 16, 16)), ("class", 4), "CrossEntropyLoss", "AdamW", {}),
    "convnext": (ConvNeXt, ("real", (4, 3, 16, 16)), ("class", 4), "CrossEntropyLoss", "AdamW", {}),
    "resnet_basic": (resnet_basic, ("real", (4, 3, 16, 16)), ("class", 4), "CrossEntropyLoss", "AdamW", {}),
    "resnet_bottleneck": (resnet_bottleneck, ("real", (4, 3, 16, 16)), ("real", 3), "MSELoss", "SGD", {}),
    "unet": (unet, ("real", (2, 3, 8, 8)), ("real", (2, 2, 8, 8)), "MSELoss", "AdamW", {}),
    "unet_nearest": (unet_nearest, ("real", (2, 3, 8, 8)), ("binary", (2, 3, 8, 8)), "BCEWithLogitsLoss", "AdamW",
                     {}),
    "audio1d": (AudioNet, ("real", (4, 1, 64)), ("class", 5), "CrossEntropyLoss", "AdamW", {}),
    "normnet_dyn": (NormNet, ("real", (5, 3, 8, 8)), ("class", 3), "CrossEntropyLoss", "AdamW", {"dynamic": True}),
    "cnn_dyn": (cnn_dynamic, ("real", (5, 3, 8, 8)), ("class", 4), "CrossEntropyLoss", "SGD", {"dynamic": True}),
    "encoder_padmask": (EncoderPadMask, ("tokens", (4, SEQ)), ("class", 3), "CrossEntropyLoss", "AdamW",
                        {"pad": True}),
    "encoder_causal": (EncoderCausal, ("tokens", (3, SEQ)), ("class_flat", VOCAB), "CrossEntropyLoss", "AdamW", {}),
    "gpt2": (Gpt2, ("tokens", (3, SEQ)), ("class_flat", VOCAB), "CrossEntropyLoss", "AdamW", {}),
    "vit_dyn": (ViT, ("real", (4, 3, 8, 8)), ("class", 4), "CrossEntropyLoss", "AdamW", {"dynamic": True}),
    "t5": (T5Encoder, ("tokens", (4, SEQ)), ("class", 3), "CrossEntropyLoss", "SGD", {}),
    "bert_pad": (BertPad, ("tokens", (4, SEQ)), ("binary", 4), "BCEWithLogitsLoss", "AdamW", {"pad": True}),
    "lstm_bi2": (LstmBi2, ("real", (3, 5, 4)), ("class", 3), "CrossEntropyLoss", "AdamW", {}),
    "gru_embed": (GruEmbed, ("tokens", (3, 6)), ("class", 4), "CrossEntropyLoss", "AdamW", {}),
    "lstm_tagger": (LstmTagger, ("real", (5, 3, 4)), ("real", (5, 3, 2)), "L1Loss", "SGD", {}),
    "gru_sensor": (GruSensor, ("real", (4, 12, 6)), ("class", 4), "CrossEntropyLoss", "AdamW", {}),
    "lstm_sensor": (LstmSensor, ("real", (4, 10, 4)), ("class", 3), "CrossEntropyLoss", "AdamW", {}),
    "rnn_elman": (ElmanRnn, ("real", (3, 5, 4)), ("class", 3), "CrossEntropyLoss", "AdamW", {}),
    "mlp_acts": (mlp_acts, ("real", (6, 6)), ("real", 3), "MSELoss", "SGD", {}),
    "mlp_nll": (MlpNll, ("real", (6, 6)), ("none", 5), None, "AdamW", {}),
    "mlp_ce_inmodel": (MlpCeInModel, ("real", (6, 6)), ("none", 5), None, "AdamW", {}),
    "mlp_nll_smooth": (MlpNllSmooth, ("real", (6, 6)), ("none", 5), None, "AdamW", {}),
    "mlp_nll_log": (MlpNllLog, ("real", (6, 6)), ("none", 5), None, "SGD", {"dynamic": True}),
    "encoder_mask_input": (EncoderMaskInput, ("tokens", (4, SEQ)), ("class", 3), "CrossEntropyLoss", "AdamW",
                           {"pad": True, "extra": lambda x: {"pad_mask": x == PAD},
                            "axes": {"input": {0: "batch", 1: "seq"}, "pad_mask": {0: "batch", 1: "seq"},
                                     "output": {0: "batch"}}}),
    "unet_dyn": (unet, ("real", (3, 3, 8, 8)), ("real", (3, 2, 8, 8)), "MSELoss", "SGD", {"dynamic": True}),
    "audio_dyn": (AudioDynamic, ("real", (3, 2, 40)), ("class", 4), "CrossEntropyLoss", "AdamW",
                  {"axes": {"input": {0: "batch", 2: "time"}, "output": {0: "batch"}}}),
    "mlp_dyn_bce": (mlp_dyn_bce, ("real", (7, 6)), ("binary", 4), "BCEWithLogitsLoss", "AdamW", {"dynamic": True}),
    "mlp_dyn_l1": (mlp_dyn_l1, ("real", (7, 6)), ("real", 2), "L1Loss", "SGD", {"dynamic": True}),
    "hand_gemm": ("hand", ("real", (4, 5)), ("real", 4), "MSELoss", "AdamW", {}),
    "hand_conv": ("hand", ("real", (3, 3, 9, 9)), ("class", 4), "CrossEntropyLoss", "AdamW", {}),
    "hand_resize": ("hand", ("real", (2, 2, 5, 5)), ("real", 2), "L1Loss", "AdamW", {}),
}


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode()) % 10_000 + 7


def make_inputs(name: str, gen: torch.Generator) -> torch.Tensor:
    _, (kind, shape), *_rest = SPECS[name]
    options = SPECS[name][5]
    if kind == "tokens":
        x = torch.randint(1, VOCAB, shape, generator=gen)
        if options.get("pad"):
            for row in range(shape[0]):
                keep = SEQ - row  # row r keeps SEQ - r tokens, then PAD (row 0 unpadded)
                x[row, keep:] = PAD
        return x
    return torch.randn(*shape, generator=gen)


def make_labels(name: str, out_shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    _, _, (kind, classes), *_ = SPECS[name]
    if kind == "class":
        return rng.integers(0, classes, size=out_shape[0]).astype(np.int64)
    if kind == "class_flat":
        return rng.integers(0, classes, size=out_shape[0]).astype(np.int64)
    if kind == "none":
        return rng.integers(0, classes, size=out_shape[0]).astype(np.int64)
    if kind == "binary":
        return rng.integers(0, 2, size=out_shape).astype(np.float32)
    return rng.standard_normal(out_shape).astype(np.float32)


def zero_dropout_forward(model: onnx.ModelProto) -> onnx.ModelProto:
    """tests/test_artifacts.py's zero_dropout: every Dropout reads a new ratio-0 initializer, the nodes kept."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for node in model.graph.node:
        if node.op_type == "Dropout":
            name = f"{node.output[0]}.zero_ratio"
            model.graph.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), name))
            while len(node.input) < 2:
                node.input.append("")
            node.input[1] = name
    return model


def ops_of(model: onnx.ModelProto) -> list[str]:
    return sorted({(f"{n.domain}::" if n.domain not in ("", "ai.onnx") else "") + n.op_type for n in model.graph.node
                   if n.op_type != "Constant"})


def export(name: str, directory: Path, gen: torch.Generator):
    """(torch module or HandBuilt, exported ModelProto, feeds by input name, trainable names, mirror params)."""
    factory, _, (label_kind, _), loss, _, options = SPECS[name]
    x = make_inputs(name, gen)
    rng = np.random.default_rng(seed_of(name))
    if factory == "hand":
        hb = HAND[name]
        nodes, params, consts, ins, outs = hb.graph_fn(gen)
        inits = [numpy_helper.from_array(v, k) for k, v in params.items()] + consts
        graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, s)
                                                for k, s in ins.items()],
                                  [helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, s)
                                   for k, s in outs.items()], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        onnx.checker.check_model(model, full_check=True)
        with torch.no_grad():
            out = hb.torch_fn({k: torch.from_numpy(v) for k, v in params.items()}, x)
        feeds = {"input": x.numpy().astype(np.float32)}
        feeds["labels" if loss == "CrossEntropyLoss" else "target"] = make_labels(name, tuple(out.shape), rng)
        return hb, model, feeds, list(params), params
    module = factory()
    randomize_batch_norm_all(module, gen)
    perturb_constant_parameters(module, gen)
    module.train()
    path = directory / "export.onnx"
    dynamic = {"input": {0: "batch"}, "output": {0: "batch"}} if options.get("dynamic") else None
    dynamic = options.get("axes", dynamic)
    extra = options["extra"](x) if "extra" in options else {}  # more forward inputs, made from the batch
    if label_kind == "none":
        labels = make_labels(name, (x.shape[0],), rng)
        args, names = (x, *extra.values(), torch.from_numpy(labels)), ["input", *extra, "labels"]
        if dynamic:
            dynamic = {"input": {0: "batch"}, "labels": {0: "batch"}}
    else:
        args, names = (x, *extra.values()), ["input", *extra]
    torch.onnx.export(module, args, str(path), input_names=names, output_names=["output"], opset_version=17,
                      do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING, dynamo=False,
                      dynamic_axes=dynamic)
    model = onnx.load(str(path))
    path.unlink()
    feeds = {"input": x.numpy() if x.dtype == torch.int64 else x.numpy().astype(np.float32)}
    feeds |= {k: v.numpy() for k, v in extra.items()}
    if label_kind == "none":
        feeds["labels"] = labels
    else:
        with torch.no_grad():
            out = copy.deepcopy(module)(x, *extra.values())
        feeds["labels" if loss == "CrossEntropyLoss" else "target"] = make_labels(name, tuple(out.shape), rng)
    trainable_torch = [n for n, _ in module.named_parameters()]
    return module, model, feeds, trainable_torch, None


def randomize_batch_norm_all(model: nn.Module, gen: torch.Generator) -> None:
    randomize_batch_norm(model, gen)  # BatchNorm1d/2d: distinct weights, biases, running statistics


def torch_loss(loss: str | None, output, target):
    if loss is None:
        return output
    if loss == "CrossEntropyLoss":
        return F.cross_entropy(output, target)
    if loss == "MSELoss":
        return F.mse_loss(output, target.double())
    if loss == "BCEWithLogitsLoss":
        return F.binary_cross_entropy_with_logits(output, target.double())
    if loss == "L1Loss":
        return F.l1_loss(output, target.double())
    raise NotImplementedError(loss)


def torch_f64_step(name, module, feeds, initial, trainable, mirror) -> dict[str, np.ndarray]:
    """loss and grad.<p> of a float64 copy (dropout 0, train mode) holding ``initial``; for a hand-built graph its
    torch mirror on the initializers."""
    _, _, (label_kind, _), loss, _, _ = SPECS[name]
    x = torch.from_numpy(feeds["input"])
    x = x.double() if x.is_floating_point() else x
    label_name = "labels" if "labels" in feeds else "target"
    target = torch.from_numpy(feeds[label_name])
    if mirror is not None:
        params = {k: torch.tensor(initial[k], dtype=torch.float64, requires_grad=True) for k in mirror}
        value = torch_loss(loss, module.torch_fn(params, x), target)
        value.backward()
        return {"loss": value.detach().numpy()} | {f"grad.{k}": params[k].grad.numpy() for k in trainable}
    model = copy.deepcopy(module).double()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
        if isinstance(m, nn.RNNBase):
            m.dropout = 0.0
    model.train()
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for k, v in initial.items():
            if k in state and tuple(state[k].shape) == v.shape:
                state[k].copy_(torch.from_numpy(v))
    params = dict(model.named_parameters())
    # batch norm's running statistics as onnxruntime-training's BatchNormInternal updates them: momentum 0.9 on
    # the running value (torch's 0.1) and the batch's *biased* variance (torch uses the unbiased one)
    stats: dict[str, np.ndarray] = {}
    names = {m: n for n, m in model.named_modules()}

    def bn_hook(m, args):
        x_in = args[0].detach()
        axes = [0] + list(range(2, x_in.dim()))
        prefix = f"{names[m]}." if names[m] else ""
        stats[f"buffer.{prefix}running_mean"] = (0.9 * m.running_mean + 0.1 * x_in.mean(axes)).numpy()
        stats[f"buffer.{prefix}running_var"] = (0.9 * m.running_var + 0.1 * x_in.var(axes, unbiased=False)).numpy()

    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.register_forward_pre_hook(bn_hook)
    extra = [torch.from_numpy(v) for k, v in feeds.items() if k not in ("input", "labels", "target")]
    if label_kind == "none":
        value = model(x, *extra, target)
    else:
        value = torch_loss(loss, model(x, *extra), target)
    value.backward()
    out = {"loss": value.detach().numpy()}
    for p in trainable:
        if p not in params or params[p].grad is None:
            raise RuntimeError(f"torch has no gradient for {p!r}")
        out[f"grad.{p}"] = params[p].grad.numpy()
    return out | stats


def optimizer_step(optimizer: str, lr: float, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]
                   ) -> dict[str, np.ndarray]:
    """The first optimizer step (zero moments, step 1) in float64 with generate_artifacts' attributes:
    SGDOptimizerV2 p - lr g; AdamWOptimizer adam_mode 1 (denominator sqrt(v) + eps, bias-corrected step size)."""
    out = {}
    for p, g in grads.items():
        w, g = params[p].astype(np.float64), g.astype(np.float64)
        if optimizer == "SGD":
            out[p] = w - lr * g
            continue
        a, b, eps = ADAMW["alpha"], ADAMW["beta"], ADAMW["epsilon"]
        m, v = (1 - a) * g, (1 - b) * g * g
        step_size = lr * math.sqrt(1 - b) / (1 - a)
        out[p] = w - step_size * m / (np.sqrt(v) + eps)
    return out


def ort_reference(name, directory, forward, feeds, trainable, frozen, loss, optimizer):
    """onnxruntime-training: generate_artifacts on the patched export, one Module + Optimizer step."""
    import onnxruntime
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    onnxruntime.set_default_logger_severity(3)
    ort_dir = directory / "ort"
    shutil.rmtree(ort_dir, ignore_errors=True)
    ort_dir.mkdir()
    patched = patch_forward(onnx.ModelProto.FromString(forward.SerializeToString()))
    stage = "generate_artifacts"
    try:
        artifacts.generate_artifacts(patched, requires_grad=trainable, frozen_params=frozen,
                                     loss=getattr(artifacts.LossType, loss) if loss else None,
                                     optimizer=getattr(artifacts.OptimType, optimizer),
                                     artifact_directory=str(ort_dir))
        for f in ("training_model.onnx", "eval_model.onnx"):
            zero_dropout_ratios(ort_dir / f)
        stage = "runtime"
        state = CheckpointState.load_checkpoint(str(ort_dir / "checkpoint"))
        module = Module(str(ort_dir / "training_model.onnx"), state, device="cpu")
        opt = Optimizer(str(ort_dir / "optimizer_model.onnx"), module)
        lr = float(opt.get_learning_rate())
        module.train()
        inputs = [feeds[n] for n in user_inputs(ort_dir / "training_model.onnx", trainable, frozen)]
        initial = {p: np.array(state.parameters[p].data) for p in trainable + frozen}
        loss1 = module(*inputs)
        grads = {p: np.array(state.parameters[p].grad) for p in trainable}
        opt.step()
        after = {p: np.array(state.parameters[p].data) for p in trainable + frozen}
        ops = {f: ops_of(onnx.load(str(ort_dir / f))) for f in ("training_model.onnx",)}
        return {"loss": float(np.asarray(loss1)), "grads": grads, "params": after, "initial": initial, "lr": lr,
                "training_ops": ops["training_model.onnx"]}
    except Exception as exc:  # noqa: BLE001 -- a finding, recorded
        return {"failure": f"{stage}: {summarize(exc)}", "traceback": traceback.format_exc()[-3000:]}


def summarize(exc: Exception) -> str:
    """onnxruntime's one useful sentence out of its C++ signature-laden message."""
    text = " ".join(str(exc).split())
    where = text.split(" ", 1)[0].rsplit("/", 1)[-1] if text.startswith("/") else ""
    for marker in ("was false.", "[ONNXRuntimeError] : "):
        if marker in text:
            before, after = text.split(marker, 1)
            if not after.strip():  # the failed condition itself is the message
                after = before.rsplit(" const ", 1)[-1] + " " + marker
            return f"{where} {after.strip()}"[:400].strip()
    return f"{type(exc).__name__}: {text}"[:400]


def user_inputs(training_model: Path, trainable, frozen) -> list[str]:
    model = onnx.load(str(training_model))
    skip = set(trainable) | set(frozen) | {"lazy_reset_grad"}
    return [i.name for i in model.graph.input if i.name not in skip and not i.name.endswith(BUFFER)]


def record(name: str, out_root: Path) -> dict:
    directory = out_root / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    torch.manual_seed(seed_of(name))
    gen = torch.Generator().manual_seed(seed_of(name))
    _, _, (label_kind, _), loss, optimizer, options = SPECS[name]
    module, exported, feeds, trainable_torch, mirror = export(name, directory, gen)
    forward = zero_dropout_forward(exported)
    onnx.save(forward, str(directory / "forward_model.onnx"))
    init_names = [t.name for t in exported.graph.initializer]
    trainable = [n for n in init_names if n in set(trainable_torch)]
    unmapped = [n for n in trainable_torch if n not in set(init_names)]
    frozen = [t.name for t in exported.graph.initializer if t.name not in set(trainable)]
    initial = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    np.savez_compressed(directory / "initial_params.npz", **{k: initial[k] for k in trainable + frozen})

    ort = ort_reference(name, directory, exported, feeds, trainable, frozen, loss, optimizer)
    inputs = list(feeds)  # the forward inputs, then the loss block's labels
    np.savez_compressed(directory / "data.npz", **feeds)
    lr = ort.get("lr", DEFAULT_LR)
    truth, truth_error = None, None
    try:
        truth = torch_f64_step(name, module, feeds, initial, trainable, mirror)
        np.savez_compressed(directory / "torch_f64.npz", **truth)
    except Exception as exc:  # noqa: BLE001
        truth_error = f"{type(exc).__name__}: {exc}"
    meta = {"name": name, "description": (module.graph_fn.__doc__ if mirror is not None else
                                          (type(module).__doc__ or repr(module)))[:2000],
            "ops": ops_of(exported), "trainable_params": trainable, "frozen_params": frozen,
            "torch_params_not_initializers": unmapped, "loss": loss, "optimizer": optimizer, "learning_rate": lr,
            "inputs": inputs, "dynamic_batch": bool(options.get("dynamic")), "seed": seed_of(name),
            "ort_failure": ort.get("failure"), "torch_truth_error": truth_error}
    if "failure" not in ort and truth is not None:
        scale = max(float(np.abs(truth[f"grad.{p}"]).max()) for p in trainable)
        gap = max(float(np.abs(ort["grads"][p] - truth[f"grad.{p}"]).max()) for p in trainable) / max(scale, 1e-30)
        if gap > ARRAY_TOL:  # onnxruntime-training's own step is wrong: the float64 truth is the reference
            worst = max(trainable, key=lambda p: float(np.abs(ort["grads"][p] - truth[f"grad.{p}"]).max()))
            meta["ort_wrong"] = f"its gradients err {gap:.2g} of the largest entry against float64 torch "\
                                f"(worst: {worst})"
            ort = {"failure": f"wrong gradients: {meta['ort_wrong']}", "traceback": None, "grads": ort["grads"]}
            meta["ort_failure"] = ort["failure"]
    if "failure" not in ort:
        ref = {"loss": np.asarray(ort["loss"], np.float32)}
        ref |= {f"grad.{p}": g for p, g in ort["grads"].items()}
        ref |= {f"param.{p}": v for p, v in ort["params"].items()}
        meta["truth"] = "onnxruntime-training"
        meta["ort_training_ops"] = ort["training_ops"]
        changed = [p for p in ort["initial"] if not np.array_equal(ort["initial"][p], initial[p])]
        meta["ort_checkpoint_differs_from_initializers"] = changed
        if truth is not None:
            scale = max(float(np.abs(truth[f"grad.{p}"]).max()) for p in trainable)
            meta["ort_vs_torch_f64"] = {
                "loss_rel": abs(ort["loss"] - float(truth["loss"])) / max(abs(float(truth["loss"])), 1e-30),
                "grad_of_largest": max(float(np.abs(ort["grads"][p] - truth[f"grad.{p}"]).max())
                                       for p in trainable) / max(scale, 1e-30)}
            stats = [k[len("buffer."):] for k in truth if k.startswith("buffer.")]
            if stats:  # the running-statistics formula above against onnxruntime-training's (the fallback's)
                meta["running_stats_formula_vs_ort"] = max(rel(truth[f"buffer.{k}"], ort["params"][k]) for k in stats)
            # the optimizer formulas above against onnxruntime-training's own step (self-check of the fallback)
            mine = optimizer_step(optimizer, lr, initial, ort["grads"])
            meta["optimizer_formula_vs_ort"] = max(
                float(np.abs(mine[p] - ort["params"][p]).max()) / max(float(np.abs(ort["params"][p]).max()), 1e-30)
                for p in trainable)
    elif truth is not None:
        meta["truth"] = "torch-f64"
        meta["ort_traceback"] = ort.get("traceback")
        ref = {"loss": np.asarray(truth["loss"])} | {f"grad.{p}": truth[f"grad.{p}"] for p in trainable}
        ref |= {f"param.{p}": v for p, v in optimizer_step(optimizer, lr, initial,
                                                           {p: truth[f"grad.{p}"] for p in trainable}).items()}
        ref |= {f"param.{k[len('buffer.'):]}": v for k, v in truth.items() if k.startswith("buffer.")}
    else:
        meta["truth"] = None
        ref = None
    if ref is not None:
        np.savez_compressed(directory / "reference.npz", **ref)
    (directory / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


# ======================================================= oplower's artifacts in onnxruntime-training =================

def rel(got, want, floor=0.0) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if want.size == 0:
        return 0.0
    return float(np.abs(got - want).max()) / max(float(np.abs(want).max()), floor, 1e-30)


def compare(ref: dict, loss: float, grads: dict, params: dict, trainable: list[str]) -> dict:
    """Errors against the reference: loss relative; each gradient against max(its largest entry, 1e-2 of the
    model's largest gradient entry) (a gradient that is zero to rounding: a bias before a BatchNorm); each
    parameter against its largest entry. Worst over parameters, with the parameter's name."""
    floor = 1e-2 * max(float(np.abs(ref[f"grad.{p}"]).max()) for p in trainable)
    g = max(((rel(grads[p], ref[f"grad.{p}"], floor), p) for p in trainable), default=(0.0, ""))
    prm = max(((rel(params[p], ref[f"param.{p}"]), p) for p in params if f"param.{p}" in ref), default=(0.0, ""))
    want = float(ref["loss"])
    return {"loss": abs(loss - want) / max(abs(want), 1e-30), "grad": g[0], "grad_param": g[1], "param": prm[0],
            "param_name": prm[1]}


def run_ours(directory: Path) -> dict:
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    meta = json.loads((directory / "meta.json").read_text())
    ours = directory / "oplower"
    data = dict(np.load(directory / "data.npz"))
    init = dict(np.load(directory / "initial_params.npz"))
    ref = dict(np.load(directory / "reference.npz"))
    trainable, frozen = meta["trainable_params"], meta["frozen_params"]
    state = CheckpointState.load_checkpoint(str(ours / "checkpoint"))
    for p in trainable + frozen:
        if not np.array_equal(np.array(state.parameters[p].data), init[p]):
            return {"error": f"our checkpoint's {p} differs from initial_params.npz"}
    module = Module(str(ours / "training_model.onnx"), state, str(ours / "eval_model.onnx"), device="cpu")
    opt = Optimizer(str(ours / "optimizer_model.onnx"), module)
    opt.set_learning_rate(meta["learning_rate"])
    module.train()
    loss = float(np.asarray(module(*[data[n] for n in meta["inputs"]])))
    grads = {p: np.array(state.parameters[p].grad) for p in trainable}
    opt.step()
    params = {p: np.array(state.parameters[p].data) for p in trainable + frozen}
    return compare(ref, loss, grads, params, trainable)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"models (default: all {len(SPECS)})")
    parser.add_argument("--out", type=Path, default=Path("/tmp/heldout"))
    parser.add_argument("--run-ours", type=Path, help="a recorded model directory with oplower's artifacts in oplower/")
    args = parser.parse_args()
    if args.run_ours:
        try:
            result = run_ours(args.run_ours)
        except Exception as exc:  # noqa: BLE001
            first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
            result = {"error": f"{type(exc).__name__}: {first[:400]}"}
        print(json.dumps(result))
        return
    unknown = sorted(set(args.names) - set(SPECS))
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; known: {sorted(SPECS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or SPECS:
        try:
            meta = record(name, args.out)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            print(f"{name:18s} RECORDING FAILED: {type(exc).__name__}: {exc}"[:300])
            continue
        ort_note = meta["ort_failure"] or "ok"
        gap = meta.get("ort_vs_torch_f64", {}).get("grad_of_largest")
        gap_text = "" if gap is None else f" (ORT grads vs f64: {gap:.1e})"
        print(f"{name:18s} truth={meta['truth']}; onnxruntime-training: {ort_note[:160]}{gap_text}")


if __name__ == "__main__":
    main()
