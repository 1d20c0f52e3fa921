"""Gradient rules: convolution and pooling (Conv, MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool).

As onnxruntime-training's gradient builder writes them:

- Conv -> ``com.microsoft::ConvGrad(dY, X, W)`` with the forward node's attributes, one output per forward
  input (dX, dW, dB), empty where no gradient is needed; ConvTranspose -> Conv (dX) and ConvGrad (dW);
- MaxPool -> default-domain ``MaxPoolGrad(dY, Indices)``: ``prepare`` gives the forward MaxPool its Indices
  output (the eval model keeps the node as it is);
- AveragePool -> default-domain ``AveragePoolGrad(dY)`` with the forward node's attributes;
- GlobalAveragePool -> ``com.microsoft::Scale`` (dY divided by the spatial size) and Expand to X's shape.

The pool gradients' kernels (onnxruntime-training's and the lowering's) read dX's spatial dims from the type
the graph declares for dX: the rules declare it (:meth:`ForwardContext.set_type`). The training ops take
``pads`` only (their kernels ignore ``auto_pad``): a SAME_UPPER / SAME_LOWER forward node's padding is
resolved into explicit pads from X's static spatial dims. GlobalMaxPool (no training op in
onnxruntime-training) is standard ops: the gradient goes to the first maximum of each plane, as torch's
adaptive max pooling sends it.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from lowering.training.gradients.context import FLOAT_TYPES, ForwardContext, GradientContext, node_attributes
from lowering.training.gradients.registry import gradient_rule

MS = "com.microsoft"
SAME = ("SAME_UPPER", "SAME_LOWER")
SCALE_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE})


def _spatial_static(ctx: GradientContext, name: str) -> tuple[int, ...] | None:
    shape = ctx.f.shape(name)
    if shape is None or len(shape) < 3 or not all(isinstance(d, int) for d in shape[2:]):
        return None
    return tuple(int(d) for d in shape[2:])


def _explicit_pads(ctx: GradientContext, attrs: dict, kernel: list[int] | None) -> dict:
    """``attrs`` with a SAME_UPPER / SAME_LOWER ``auto_pad`` replaced by the pads it means for X's static
    spatial dims (the training ops' kernels read only ``pads``)."""
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if auto_pad not in SAME:
        return attrs
    spatial = _spatial_static(ctx, ctx.x(0))
    if spatial is None:
        raise ctx.fail(f"auto_pad {auto_pad} needs X's spatial dims static (the gradient op takes explicit pads); "
                       f"X's shape is {_shown(ctx.f.shape(ctx.x(0)))}")
    if kernel is None:
        raise ctx.fail(f"auto_pad {auto_pad}: the kernel shape is unknown")
    k = len(spatial)
    strides = list(attrs.get("strides") or [1] * k)
    dilations = list(attrs.get("dilations") or [1] * k)
    begins, ends = [], []
    for d, s, kk, dil in zip(spatial, strides, kernel, dilations, strict=True):
        out = -(-d // s)
        total = max(0, (out - 1) * s + (kk - 1) * dil + 1 - d)
        small, large = total // 2, total - total // 2
        begins.append(small if auto_pad == "SAME_UPPER" else large)
        ends.append(large if auto_pad == "SAME_UPPER" else small)
    attrs = dict(attrs)
    attrs["auto_pad"] = "NOTSET"
    attrs["pads"] = begins + ends
    return attrs


def _shown(shape) -> str:
    return "unknown" if shape is None else "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


# -- Conv --

@gradient_rule("Conv", differentiable=(0, 1, 2))
def conv(ctx: GradientContext) -> None:
    f = ctx.f
    x, w = ctx.x(0), ctx.x(1)
    attrs = node_attributes(ctx.node)
    kernel = attrs.get("kernel_shape")
    if kernel is None:
        w_shape = f.static_shape(w)
        kernel = None if w_shape is None else list(w_shape[2:])
    attrs = _explicit_pads(ctx, attrs, None if kernel is None else list(kernel))
    outputs = [f.fresh(f"{ctx.x(i)}_grad") if ctx.requires(i) else "" for i in range(min(len(ctx.node.input), 3))]
    while outputs and not outputs[-1]:
        outputs.pop()
    if not outputs:
        return
    f.node("ConvGrad", [ctx.dy(0), x, w], outputs, domain=MS, **attrs)
    for i, name in enumerate(outputs):
        if name:
            ctx.set_dx(i, name)


@gradient_rule("ConvTranspose", differentiable=(0, 1, 2))
def conv_transpose(ctx: GradientContext) -> None:
    """Y = ConvTranspose(X, W) is the adjoint of the Conv over Y's space with the same W and attributes: dX =
    Conv(dY, W); dW is that Conv's weight gradient with the roles of its input and output exchanged
    (ConvGrad(X, dY, W)'s dW); dB sums dY. onnxruntime-training's ConvTransposeGrad has no spec here: Conv
    and ConvGrad say the same. Explicit pads (torch's export) only: output_shape and SAME padding place the
    pads by rules runtimes disagree on."""
    f, x, w, dy = ctx.f, ctx.x(0), ctx.x(1), ctx.dy(0)
    attrs = node_attributes(ctx.node)
    if attrs.get("output_shape") is not None or attrs.get("auto_pad", "NOTSET") in SAME:
        raise ctx.fail("output_shape or auto_pad SAME_*: only explicit pads are supported (torch exports those)")
    conv_attrs = {k: v for k, v in attrs.items() if k in ("auto_pad", "dilations", "group", "kernel_shape", "pads",
                                                          "strides")}
    if ctx.requires(0):
        ctx.set_dx(0, f.node1("Conv", [dy, w], f.fresh(f"{x}_grad"), **conv_attrs))
    if ctx.requires(1):
        dw = f.fresh(f"{w}_grad")
        f.node("ConvGrad", [x, dy, w], ["", dw], domain=MS, **conv_attrs)
        ctx.set_dx(1, dw)
    if ctx.requires(2):
        rank = f.rank(dy) or f.rank(x)
        if rank is None:
            raise ctx.fail("the rank of the input is unknown")
        ctx.set_dx(2, f.reduce("ReduceSum", dy, [0, *range(2, rank)], keepdims=0))


# -- MaxPool --

def _max_pool_indices(node: onnx.NodeProto, f: ForwardContext) -> list[onnx.NodeProto] | None:
    """The forward MaxPool with its Indices output (the gradient scatters dY there), as onnxruntime-training's
    generator gives it one; the original output keeps its name. Where the node had no Indices output its
    ``storage_order`` cannot matter to anyone: it is dropped, so the indices are row-major."""
    if len(node.output) > 1 and node.output[1]:
        return None
    if f.elem_type(node.input[0]) not in FLOAT_TYPES | {None}:
        return None  # an integer MaxPool carries no gradient
    y = node.output[0]
    indices = f.fresh(f"{y}_mask")
    new = onnx.NodeProto()
    new.CopyFrom(node)
    del new.output[:]
    new.output.extend([y, indices])
    kept = [a for a in new.attribute if a.name != "storage_order"]
    del new.attribute[:]
    new.attribute.extend(kept)
    f.set_type(indices, onnx.TensorProto.INT64, f.shape(y))
    return [new]


@gradient_rule("MaxPool", prepare=_max_pool_indices)
def max_pool(ctx: GradientContext) -> None:
    f = ctx.f
    x, indices = ctx.x(0), ctx.y(1)
    attrs = node_attributes(ctx.node)
    if int(attrs.get("storage_order", 0)) != 0:
        raise ctx.fail("storage_order 1 (column-major Indices, an output the model uses): the gradient needs "
                       "row-major indices")
    dx = f.fresh(f"{x}_grad")
    if _spatial_static(ctx, x) is not None:
        attrs = _explicit_pads(ctx, attrs, attrs.get("kernel_shape"))
        f.node("MaxPoolGrad", [ctx.dy(0), indices], [dx], **attrs)
        f.set_type(dx, f.elem_type(x) or onnx.TensorProto.FLOAT, f.shape(x))
    elif f.opset >= 16:
        # X's spatial dims known only at run time: the summing scatter itself (the indices are flat positions
        # in the whole of X)
        flat = f.const(np.asarray([-1], np.int64), hint="flat")
        size = f.node1("Reshape", [f.node1("Size", [x]), f.const(np.asarray([1], np.int64), hint="one_dim")])
        zeros = f.node1("ConstantOfShape", [size], value=helper.make_tensor("zero", f.elem_type(x), [1], [0]))
        summed = f.node1("ScatterElements", [zeros, f.node1("Reshape", [indices, flat]),
                                             f.node1("Reshape", [ctx.dy(0), flat])], axis=0, reduction="add")
        f.node1("Reshape", [summed, f.node1("Shape", [x])], output=dx)
    else:
        raise ctx.fail(f"X's spatial dims are not static ({_shown(f.shape(x))}) and the opset is {f.opset}: "
                       "MaxPoolGrad reads them from dX's declared type, and the summing ScatterElements needs "
                       "opset 16")
    ctx.set_dx(0, dx)


# -- AveragePool --

@gradient_rule("AveragePool")
def average_pool(ctx: GradientContext) -> None:
    f = ctx.f
    x = ctx.x(0)
    attrs = node_attributes(ctx.node)
    dilations = attrs.get("dilations")
    if dilations is not None and any(int(d) != 1 for d in dilations):
        raise ctx.fail(f"dilations {list(dilations)}: AveragePoolGrad has no dilation")
    attrs = _explicit_pads(ctx, attrs, attrs.get("kernel_shape"))
    attrs.pop("dilations", None)
    if f.static_shape(x) is None:  # symbolic dims: AveragePoolGrad's kernel reads dX's whole shape (see there)
        from lowering.training.gradients.upsample import average_pool_gradient  # noqa: PLC0415

        shape = f.shape(x)
        if shape is None:
            raise ctx.fail("X's rank is unknown")
        ctx.set_dx(0, average_pool_gradient(ctx, attrs, tuple(shape[2:])))
        return
    spatial = _spatial_static(ctx, x)
    elem = f.elem_type(x) or onnx.TensorProto.FLOAT
    padded = _ceil_windows_past_the_padding(ctx, attrs, spatial)
    if padded is None:
        dx = f.node1("AveragePoolGrad", [ctx.dy(0)], f.fresh(f"{x}_grad"), **attrs)
        f.set_type(dx, elem, f.shape(x))
    else:
        # count_include_pad with ceil-mode windows that reach past the end padding: the forward divides by the
        # window's part inside the padded input, AveragePoolGrad by the whole kernel. The same pooling over
        # X padded explicitly, with no pads and count_include_pad 0, divides alike: its gradient, cut back.
        k = len(spatial)
        pads = list(attrs.get("pads") or [0] * 2 * k)
        attrs = dict(attrs, pads=[0] * 2 * k, count_include_pad=0)
        shape = f.shape(x)
        grad = f.node1("AveragePoolGrad", [ctx.dy(0)], f.fresh(f"{x}_grad_padded"), **attrs)
        f.set_type(grad, elem, list(shape[:2]) + padded)
        dx = f.node1("Slice", [grad, f.const(np.asarray(pads[:k], np.int64), hint="starts"),
                               f.const(np.asarray([p + d for p, d in zip(pads[:k], spatial, strict=True)], np.int64),
                                       hint="ends"),
                               f.axes(list(range(2, 2 + k)))], f.fresh(f"{x}_grad"))
    ctx.set_dx(0, dx)


def _pool_outputs(size: int, kernel: int, stride: int, ceil: bool) -> int:
    """Output positions of a pooling over ``size`` (padding included) as the ceil-mode convention has them: a
    last window starting past the input is dropped."""
    span = size - kernel
    count = (-(-span // stride) if ceil else span // stride) + 1
    if ceil and (count - 1) * stride >= size:
        count -= 1
    return count


def _ceil_windows_past_the_padding(ctx: GradientContext, attrs: dict, spatial: tuple[int, ...]) -> list[int] | None:
    """None where AveragePoolGrad divides as the forward did; else the spatial dims of X padded explicitly
    (count_include_pad with a ceil-mode window reaching past the end padding, on some axis)."""
    if not int(attrs.get("count_include_pad", 0)) or not int(attrs.get("ceil_mode", 0)):
        return None
    k = len(spatial)
    kernel = list(attrs["kernel_shape"])
    strides = list(attrs.get("strides") or [1] * k)
    pads = list(attrs.get("pads") or [0] * 2 * k)
    y = ctx.f.static_shape(ctx.y(0))
    outputs = list(y[2:]) if y is not None else [
        _pool_outputs(d + pads[a] + pads[a + k], kernel[a], strides[a], True) for a, d in enumerate(spatial)]
    past = any((o - 1) * s + kk > d + pads[a] + pads[a + k]
               for a, (o, s, kk, d) in enumerate(zip(outputs, strides, kernel, spatial, strict=True)))
    if not past:
        return None
    padded = [d + pads[a] + pads[a + k] for a, d in enumerate(spatial)]
    if any(_pool_outputs(p, kk, s, True) != o for p, kk, s, o in zip(padded, kernel, strides, outputs, strict=True)):
        raise ctx.fail(f"count_include_pad with ceil_mode: a window starts in the end padding (outputs {outputs} for "
                       f"input {list(spatial)} and pads {pads}); the gradient cannot be written with "
                       "AveragePoolGrad")
    return padded


# -- global pools --

@gradient_rule("GlobalAveragePool")
def global_average_pool(ctx: GradientContext) -> None:
    f = ctx.f
    x = ctx.x(0)
    elem = f.elem_type(x) or onnx.TensorProto.FLOAT
    spatial = _spatial_static(ctx, x)
    if spatial is not None:
        count = f.const(np.asarray([math.prod(spatial)], helper.tensor_dtype_to_np_dtype(elem)), hint="pool_size")
    else:
        count = f.node1("Div", [f.node1("Size", [x]), f.node1("Size", [ctx.y(0)])], hint="pool_size")
        if elem not in SCALE_TYPES:
            count = f.node1("Cast", [count], to=elem)
    if elem in SCALE_TYPES:
        scaled = f.node1("Scale", [ctx.dy(0), count], domain=MS, scale_down=1, hint="scaled_dY")
    else:  # Scale has no bf16: a Div in the forward type
        scaled = f.node1("Div", [ctx.dy(0), count], hint="scaled_dY")
    ctx.set_dx(0, f.node1("Expand", [scaled, f.node1("Shape", [x])], f.fresh(f"{x}_grad")))


@gradient_rule("GlobalMaxPool")
def global_max_pool(ctx: GradientContext) -> None:
    """dY to the first maximum of each [N, C] plane (where X equals Y and no earlier position did), zero
    elsewhere."""
    f = ctx.f
    x = ctx.x(0)
    plane_shape = f.const(np.asarray([0, 0, -1], np.int64), hint="plane_shape")
    plane = f.node1("Reshape", [x, plane_shape])                                       # [N, C, S]
    at_max = f.node1("Equal", [plane, f.node1("Reshape", [ctx.y(0), plane_shape])])
    seen = f.node1("CumSum", [f.node1("Cast", [at_max], to=onnx.TensorProto.INT32),
                              f.const(np.asarray(2, np.int64), hint="axis")])
    first = f.node1("And", [at_max, f.node1("Equal", [seen, f.const(np.asarray(1, np.int32), hint="one")])])
    zero = f.const(np.asarray(0, f.np_dtype(x)), hint="zero")
    spread = f.node1("Where", [first, f.node1("Reshape", [ctx.dy(0), plane_shape]), zero])
    ctx.set_dx(0, f.node1("Reshape", [spread, f.node1("Shape", [x])], f.fresh(f"{x}_grad")))
