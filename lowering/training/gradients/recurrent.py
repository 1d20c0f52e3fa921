"""Gradient rules: recurrent family."""

from __future__ import annotations
