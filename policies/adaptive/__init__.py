"""`adaptive`: the goodput-aware placement policy and its parts."""

from policies.native import activate as _activate

_activate(__path__, __name__)
