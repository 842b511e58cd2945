"""session-router: the router process (see `router.native` for its compiled hot path)."""

from router.native import activate as _activate

_activate(__path__, __name__)
