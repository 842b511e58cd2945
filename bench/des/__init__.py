"""The discrete-event cluster simulator: the live engine, policies and router semantics in
virtual time (see `bench.des.run.simulate`)."""

from bench.des.config import DEFAULT_ROUTER_OVERHEAD_S, SimConfig
from bench.des.results import PolicyError, PolicyFailure, SimResult, SimStats
from bench.des.run import simulate

__all__ = [
    "DEFAULT_ROUTER_OVERHEAD_S",
    "PolicyError",
    "PolicyFailure",
    "SimConfig",
    "SimResult",
    "SimStats",
    "simulate",
]
