"""Gradient rules, one module per op family (like ``lowering/rules``); importing the package registers them.

- ``elementwise`` -- Add, Sub, Mul, Div, Pow, Sqrt, Exp, Log, Neg, Abs, Erf, Sigmoid, Relu, Cast, Identity, Sum,
  Max/Min...;
- ``activation`` -- Clip, LeakyRelu, Tanh, HardSigmoid, HardSwish, Elu, Softplus...;
- ``matmul`` -- MatMul, Gemm;
- ``conv`` -- Conv, MaxPool, AveragePool, GlobalAveragePool;
- ``normalization`` -- BatchNormalization, LayerNormalization, Softmax, LogSoftmax, Dropout;
- ``shape`` -- Reshape, Flatten, Transpose, Unsqueeze, Squeeze, Concat, Split, Slice, Expand, Gather, Where, Tile,
  Pad, CumSum, Trilu, ReduceMean, ReduceSum and the other reductions...;
- ``recurrent`` -- LSTM, GRU;
- ``loss`` -- SoftmaxCrossEntropyLoss (the loss blocks' own ops).
"""

from lowering.training.gradients.registry import (
    NO_GRADIENT,
    GradientRule,
    gradient_rule,
    registered_rules,
    rule_for,
)

__all__ = ["NO_GRADIENT", "GradientRule", "gradient_rule", "registered_rules", "rule_for"]

# the families register their rules on import (kept last: they import the registry above)
from lowering.training.gradients import (  # noqa: E402, F401
    activation,
    conv,
    elementwise,
    loss,
    matmul,
    nll,
    normalization,
    normalization_extra,
    recurrent,
    rnn,
    shape,
    upsample,
)
