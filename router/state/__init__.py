"""The shared session state: records and keys, Redis as the truth, the local view on the request
path, the write queue and batcher, the Lua scripts, sync, health and the Redis connections."""

from router.native import activate as _activate

_activate(__path__, __name__)
