"""Gradient rules: activations (Clip, LeakyRelu, Tanh, HardSigmoid, HardSwish, Elu, Softplus, ...)."""

from __future__ import annotations
