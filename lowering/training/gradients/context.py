"""What a gradient rule sees and emits into.

:class:`Emitter` owns naming (fresh names never collide with a value of the model), constants (initializers,
one per distinct value) and the list of emitted nodes; :class:`ForwardContext` adds what shape inference
knows of the forward model; :class:`GradientContext` is one forward node being differentiated: its inputs and
outputs, the gradients of its outputs (``dy``), which inputs need a gradient (``requires``), and where the
rule puts them (``set_dx``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from opdef.errors import ModelError

Dim = int | str | None
Shape = tuple[Dim, ...]

FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                         onnx.TensorProto.DOUBLE})


class GradientError(ModelError):
    """A forward model the generator cannot differentiate (one line: the op, the node, the problem)."""


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """Every attribute of ``node`` by name, strings decoded."""
    out = {}
    for a in node.attribute:
        value = helper.get_attribute_value(a)
        out[a.name] = value.decode() if isinstance(value, bytes) else value
    return out


class Emitter:
    """Fresh names, constants and nodes for one generated graph."""

    def __init__(self, taken: set[str], opset: int) -> None:
        self.taken = taken
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._constants: dict[tuple, str] = {}
        self._counter = 0
        self.scope = ""  # node names are "<scope>/<op>" while a rule emits (the forward node's name + "_Grad")

    def fresh(self, hint: str) -> str:
        name = hint
        while name in self.taken or not name:
            self._counter += 1
            name = f"{hint}_{self._counter}"
        self.taken.add(name)
        return name

    def node(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str] | int = 1, *, domain: str = "",
             name: str | None = None, hint: str | None = None, **attrs: Any) -> list[str]:
        """Append one node; ``outputs`` is a list of names or a count of fresh ones. Attributes whose value is
        None are left out. Returns the output names."""
        if isinstance(outputs, int):
            base = hint or op_type.lower()
            outputs = [self.fresh(f"{base}_output" if outputs == 1 else f"{base}_output_{i}") for i in range(outputs)]
        else:
            outputs = list(outputs)
            self.taken.update(o for o in outputs if o)
        label = name or hint or op_type
        node = helper.make_node(op_type, list(inputs), outputs, name=self.fresh(f"{self.scope}/{label}" if self.scope
                                                                                else label),
                                domain=domain or None, **{k: v for k, v in sorted(attrs.items()) if v is not None})
        if not domain:
            node.ClearField("domain")
        self.nodes.append(node)
        return outputs

    def node1(self, op_type: str, inputs: Sequence[str], output: str | None = None, **kwargs: Any) -> str:
        return self.node(op_type, inputs, [output] if output else 1, **kwargs)[0]

    def const(self, value: Any, dtype: Any = None, hint: str = "const") -> str:
        """A constant initializer (one per distinct value and type)."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        name = self._constants.get(key)
        if name is None:
            name = self.fresh(hint)
            self.initializers.append(numpy_helper.from_array(array, name))
            self._constants[key] = name
        return name

    def axes(self, axes: Sequence[int]) -> str:
        return self.const(np.asarray(list(axes), np.int64), hint="axes")

    def reduce(self, op_type: str, x: str, axes: Sequence[int] | None, keepdims: int, output: str | None = None,
               hint: str | None = None) -> str:
        """ReduceSum/ReduceMean over ``axes`` in the opset's own spelling (axes an input of ReduceSum from 13 and
        of ReduceMean from 18, an attribute before)."""
        as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if axes is None:
            return self.node1(op_type, [x], output, keepdims=keepdims, hint=hint)
        if as_input:
            return self.node1(op_type, [x, self.axes(axes)], output, keepdims=keepdims, hint=hint)
        return self.node1(op_type, [x], output, keepdims=keepdims, axes=list(axes), hint=hint)


class ForwardContext(Emitter):
    """The emitter plus what is known of the forward model's values (types and shapes from shape inference)."""

    def __init__(self, taken: set[str], opset: int, types: dict[str, onnx.TypeProto],
                 constants: dict[str, np.ndarray]) -> None:
        super().__init__(taken, opset)
        self.types = types
        self.constant_values = constants

    def elem_type(self, name: str) -> int | None:
        t = self.types.get(name)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.elem_type:
            return None
        return t.tensor_type.elem_type

    def shape(self, name: str) -> Shape | None:
        """The value's shape: ints where static, a symbol name or None where not; None when the rank is unknown."""
        t = self.types.get(name)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            return None
        dims: list[Dim] = []
        for d in t.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            elif d.HasField("dim_param"):
                dims.append(d.dim_param)
            else:
                dims.append(None)
        return tuple(dims)

    def rank(self, name: str) -> int | None:
        shape = self.shape(name)
        return None if shape is None else len(shape)

    def static_shape(self, name: str) -> tuple[int, ...] | None:
        shape = self.shape(name)
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return tuple(int(d) for d in shape)  # type: ignore[arg-type]

    def constant(self, name: str) -> np.ndarray | None:
        """The value of an initializer or Constant output (not a parameter), or None."""
        return self.constant_values.get(name)

    def np_dtype(self, name: str) -> np.dtype:
        elem = self.elem_type(name)
        if elem is None:
            raise GradientError(f"the type of {name!r} is unknown (shape inference could not tell it)")
        return helper.tensor_dtype_to_np_dtype(elem)

    def set_type(self, name: str, elem_type: int, shape: Sequence[Dim] | None) -> None:
        """Record the type of a value a rule created (so later rules can read it; the training model declares it
        in its value_info, where a gradient op's kernel reads an output shape it cannot infer, e.g. MaxPoolGrad's
        dX)."""
        self.types[name] = helper.make_tensor_type_proto(elem_type, None if shape is None else list(shape))


class GradientContext:
    """One forward node being differentiated."""

    def __init__(self, fwd: ForwardContext, node: onnx.NodeProto, dys: list[str | None], requires: list[bool],
                 display: str) -> None:
        self.f = fwd
        self.node = node
        self._dys = dys
        self._requires = requires
        self.dx: dict[int, str] = {}
        self.display = display

    # -- the forward node --
    @property
    def op_type(self) -> str:
        return self.node.op_type

    def x(self, i: int) -> str:
        return self.node.input[i] if i < len(self.node.input) else ""

    def y(self, i: int) -> str:
        return self.node.output[i] if i < len(self.node.output) else ""

    def attr(self, name: str, default: Any = None) -> Any:
        for a in self.node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    # -- gradients --
    def dy(self, i: int = 0) -> str | None:
        """The gradient of output ``i``, or None where none flows back (zero)."""
        return self._dys[i] if i < len(self._dys) else None

    def requires(self, i: int) -> bool:
        return i < len(self._requires) and self._requires[i]

    def set_dx(self, i: int, name: str) -> None:
        if self.requires(i):
            self.dx[i] = name

    def fail(self, problem: str) -> GradientError:
        return GradientError(f"node {self.display} ({self.node.op_type}): {problem}")

    # -- helpers most rules need --
    def sum_to(self, grad: str, like: str, grad_of: str | None = None) -> str:
        """``grad`` (the shape of ``grad_of``, by default the node's first output) summed down to the shape of
        ``like`` under numpy broadcasting; unchanged where the shapes agree."""
        f = self.f
        target = f.shape(like)
        source = f.shape(grad_of or self.y(0))
        if target is None or source is None:
            return self.sum_to_dynamic(grad, like)
        if tuple(target) == tuple(source) and all(isinstance(d, int) for d in target):
            return grad
        lead = len(source) - len(target)
        if lead < 0:
            raise self.fail(f"cannot sum a gradient of rank {len(source)} down to rank {len(target)}")
        axes = list(range(lead))
        for i, d in enumerate(target):
            s = source[lead + i]
            if d == 1 and s != 1:
                axes.append(lead + i)
            elif d != s and not (isinstance(d, int) and isinstance(s, int) and d == s):
                if d is None or s is None or isinstance(d, str) or isinstance(s, str):
                    return self.sum_to_dynamic(grad, like)
                raise self.fail(f"shapes {list(source)} and {list(target)} do not broadcast")
        return self.reduce_to(grad, axes, lead, like)

    def reduce_to(self, grad: str, axes: list[int], lead: int, like: str) -> str:
        """``grad`` summed over ``axes`` (kept), then reshaped to ``like``'s shape when ``lead`` leading axes
        must go (a constant shape where it is static); unchanged when there is nothing to sum."""
        if not axes:
            return grad
        f = self.f
        out = f.reduce("ReduceSum", grad, axes, keepdims=1, hint="reduce_grad")
        if lead:
            static = f.static_shape(like)
            shape = f.const(np.asarray(static, np.int64), hint="shape") if static is not None else \
                f.node1("Shape", [like])
            out = f.node1("Reshape", [out, shape])
        return out

    def sum_to_dynamic(self, grad: str, like: str) -> str:
        """Broadcast reduction when static shapes do not tell it: sum over every axis of ``grad`` where the
        target (padded with leading ones) is 1, computed from the runtime shapes, then reshape."""
        f = self.f
        gshape = f.node1("Shape", [grad])
        tshape = f.node1("Shape", [like])
        grank = f.node1("Size", [gshape])
        trank = f.node1("Size", [tshape])
        pad = f.node1("Sub", [grank, trank])
        ones = f.node1("Expand", [f.const(np.ones(1, np.int64)), f.node1("Unsqueeze", [pad, f.axes([0])])])
        padded = f.node1("Concat", [ones, tshape], axis=0)
        is_one = f.node1("Equal", [padded, f.const(np.ones(1, np.int64))])
        axes = f.node1("Reshape", [f.node1("NonZero", [is_one]), f.const(np.array([-1], np.int64))])
        summed = f.node1("ReduceSum", [grad, axes], keepdims=1, noop_with_empty_axes=1)
        return f.node1("Reshape", [summed, tshape])
