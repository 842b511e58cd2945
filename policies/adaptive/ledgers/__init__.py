"""What the adaptive policy remembers of its own recent placements, one ledger per concern."""

from policies.native import activate as _activate

_activate(__path__, __name__)
