"""A kit for policy authors: views built by hand, and the properties every policy must keep.

Test-only: it imports hypothesis (the `testing` extra), and the router never imports it.
"""

from policies.testing.properties import (
    DEFAULT_EXAMPLES,
    PolicyFactory,
    PolicyPropertyError,
    Step,
    check_affinity,
    check_deterministic,
    check_feasible,
    check_handoff,
    check_policy,
    check_round_trip,
    clusters,
    steps,
    turns,
)
from policies.testing.views import KV, turn, view, w

__all__ = [
    "DEFAULT_EXAMPLES",
    "KV",
    "PolicyFactory",
    "PolicyPropertyError",
    "Step",
    "check_affinity",
    "check_deterministic",
    "check_feasible",
    "check_handoff",
    "check_policy",
    "check_round_trip",
    "clusters",
    "steps",
    "turn",
    "turns",
    "view",
    "w",
]
