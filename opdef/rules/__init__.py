"""Verification rules keyed by ``binding.rule``; the rule ``key`` lives in ``opdef.rules.<key>`` and is
imported (so registered) on first lookup through :func:`rule_for`."""

from opdef.rules.base import RULES, NodeContext, RuleResult, register_rule, rule_for

__all__ = ["RULES", "NodeContext", "RuleResult", "register_rule", "rule_for"]
