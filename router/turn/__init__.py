"""A turn's path through the router: its fields, the pipeline, execution, legs, relay and usage."""

from router.native import activate as _activate

_activate(__path__, __name__)
