"""The configured workers: their load and health from scrapes of their /metrics."""

from router.native import activate as _activate

_activate(__path__, __name__)
