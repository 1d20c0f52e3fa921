"""Gradient rules: conv family."""

from __future__ import annotations
