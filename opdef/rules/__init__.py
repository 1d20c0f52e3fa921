"""Verification rules keyed by ``binding.rule``; importing this package registers every bundled rule."""

from opdef.rules import batch_norm_backward, batch_norm_internal  # noqa: F401  (register their rules)
from opdef.rules.base import RULES, NodeContext, RuleResult, register_rule

__all__ = ["RULES", "NodeContext", "RuleResult", "register_rule"]
