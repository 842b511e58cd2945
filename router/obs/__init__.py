"""What the router tells about itself: stage events per turn, and its Prometheus metrics."""

from router.native import activate as _activate

_activate(__path__, __name__)
