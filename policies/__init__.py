"""Placement policies: pure `decide(turn, view) -> Decision`, shared by router and simulator.

Imports nothing of the project outside this package and no I/O library (msgspec only).
"""

from policies.native import activate as _activate

_activate(__path__, __name__)  # before the imports below: they load the compiled modules

from policies.adaptive.policy import AdaptiveParams, AdaptivePolicy
from policies.base import Policy
from policies.params import NoParams, PolicyConfigError
from policies.registry import (
    BUILTIN_POLICIES,
    ENTRY_POINT_GROUP,
    available_policies,
    create_policy,
    parse_param_assignments,
)
from policies.types import (
    Action,
    ClusterView,
    Colocate,
    Decision,
    Handoff,
    LinkView,
    Migrate,
    Objectives,
    Outcome,
    Prediction,
    Recompute,
    Reject,
    Residency,
    Role,
    Turn,
    WorkerView,
    action_of,
)

__all__ = [
    "BUILTIN_POLICIES",
    "ENTRY_POINT_GROUP",
    "Action",
    "AdaptiveParams",
    "AdaptivePolicy",
    "ClusterView",
    "Colocate",
    "Decision",
    "Handoff",
    "LinkView",
    "Migrate",
    "NoParams",
    "Objectives",
    "Outcome",
    "Policy",
    "PolicyConfigError",
    "Prediction",
    "Recompute",
    "Reject",
    "Residency",
    "Role",
    "Turn",
    "WorkerView",
    "action_of",
    "available_policies",
    "create_policy",
    "parse_param_assignments",
]
