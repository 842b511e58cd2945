"""Find and build placement policies by name, in the style of llm-d's scheduler plugins.

A spec is one of:
- a built-in name ("round-robin", "colocate", "disaggregate", "threshold", "adaptive");
- the name of an entry point in the group `session_router.policies` (third-party plugins);
- `module:attr`, any importable class.
A name matches with underscores for dashes and the other way round (`round_robin`, as
vllm-router and sglang-router spell theirs), when it matches nothing as given.

A policy factory is a class with a `Params` class attribute (a frozen msgspec Struct with
forbid_unknown_fields=True) whose constructor takes one argument, the validated `Params`.
Parameters arrive as strings (command line), typed values (TOML) or JSON (admin call) and are
converted leniently ("2048" -> 2048); every problem raises `PolicyConfigError`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

import msgspec

from policies.adaptive.policy import AdaptivePolicy
from policies.base import Policy
from policies.baselines.colocate import ColocatePolicy
from policies.baselines.disaggregate import DisaggregatePolicy
from policies.baselines.round_robin import RoundRobinPolicy
from policies.baselines.threshold import ThresholdPolicy
from policies.params import PolicyConfigError

ENTRY_POINT_GROUP = "session_router.policies"
_T = TypeVar("_T")

BUILTIN_POLICIES: Mapping[str, type] = {
    "round-robin": RoundRobinPolicy,
    "colocate": ColocatePolicy,
    "disaggregate": DisaggregatePolicy,
    "threshold": ThresholdPolicy,
    "adaptive": AdaptivePolicy,
}

# msgspec reports a field's type error as "Expected `int`, got `str` - at `$.threshold`".
_AT_FIELD = re.compile(r" - at `\$\.(?P<field>[^`.\[]+)[^`]*`$")


def available_policies() -> list[str]:
    """Built-in policy names, then plugin names from entry points, each sorted, no repeats."""
    plugins = sorted(set(_entry_points()) - set(BUILTIN_POLICIES))
    return [*BUILTIN_POLICIES, *plugins]


def create_policy(spec: str, params: Mapping[str, object] | None = None) -> Policy:
    """Build the policy `spec` names, with `params` validated against its `Params` struct."""
    factory = _resolve(spec)
    params_type = getattr(factory, "Params", None)
    if not (isinstance(params_type, type) and issubclass(params_type, msgspec.Struct)):
        raise PolicyConfigError(
            f"policy {spec!r}: {_qualname(factory)} must declare `Params`, a msgspec Struct"
        )
    given = dict(params or {})
    allowed = params_type.__struct_encode_fields__
    allowed_text = ", ".join(allowed) if allowed else "(none)"
    for key in given:
        if key not in allowed:
            raise PolicyConfigError(
                f"policy {spec!r}: unknown parameter {key!r}; allowed keys: {allowed_text}"
            )
    try:
        validated = msgspec.convert(given, type=params_type, strict=False)
    except msgspec.ValidationError as error:
        raise PolicyConfigError(
            f"policy {spec!r}: {_describe(error)}; allowed keys: {allowed_text}"
        ) from error
    policy = factory(validated)
    if not isinstance(policy, Policy):
        raise PolicyConfigError(
            f"policy {spec!r}: {_qualname(factory)} does not implement Policy "
            "(name, decide, observe)"
        )
    return policy


def parse_param_assignments(assignments: Iterable[str]) -> dict[str, str]:
    """Parse command-line `key=value` strings; values stay strings for `create_policy`."""
    parsed: dict[str, str] = {}
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        key = key.strip()
        if not sep or not key:
            raise PolicyConfigError(f"policy parameter {assignment!r} is not of the form key=value")
        if key in parsed:
            raise PolicyConfigError(f"policy parameter {key!r} is given more than once")
        parsed[key] = value.strip()
    return parsed


def _same_name(name: str) -> str:
    return name.replace("_", "-")


def _find(spec: str, known: Mapping[str, _T]) -> _T | None:
    """`known[spec]`, else the one entry whose name equals spec's with `_` and `-` alike."""
    found = known.get(spec)
    if found is not None:
        return found
    alike = [value for name, value in known.items() if _same_name(name) == _same_name(spec)]
    return alike[0] if len(alike) == 1 else None


def _resolve(spec: str) -> type:
    if ":" in spec:
        return _load_class(spec, spec, lambda: _import_attr(spec))
    builtin = _find(spec, BUILTIN_POLICIES)
    if builtin is not None:
        return builtin
    entry_point = _find(spec, _entry_points())
    if entry_point is None:
        names = ", ".join(available_policies())
        raise PolicyConfigError(
            f"unknown policy {spec!r}; available: {names} (or module:attr for any class)"
        )
    return _load_class(spec, entry_point.value, entry_point.load)


def _load_class(spec: str, target: str, load: Callable[[], object]) -> type:
    try:
        loaded = load()
    except (ImportError, AttributeError, ValueError) as error:
        raise PolicyConfigError(f"policy {spec!r}: cannot load {target!r}: {error}") from error
    if not isinstance(loaded, type):
        raise PolicyConfigError(f"policy {spec!r}: {target!r} is not a class")
    return loaded


def _import_attr(target: str) -> object:
    module_name, _, attr = target.partition(":")
    loaded: object = importlib.import_module(module_name)
    for part in attr.split("."):
        loaded = getattr(loaded, part)
    return loaded


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    # Looked up on every call (a few ms, only at policy creation) so a plugin installed while
    # the router runs is found by the next admin call.
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {entry_point.name: entry_point for entry_point in found}


def _describe(error: msgspec.ValidationError) -> str:
    message = str(error)
    match = _AT_FIELD.search(message)
    if match is None:
        return f"invalid parameters: {message}"
    return f"parameter {match['field']!r}: {message[: match.start()]}"


def _qualname(factory: type) -> str:
    return f"{factory.__module__}:{factory.__qualname__}"
