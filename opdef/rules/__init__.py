"""Verification rules keyed by ``binding.rule``; importing this package registers every bundled rule."""

from opdef.rules import batch_norm_backward  # noqa: F401  (registers "batch_norm_backward")
from opdef.rules.base import RULES, NodeContext, RuleResult, register_rule

__all__ = ["RULES", "NodeContext", "RuleResult", "register_rule"]
