"""The numbers that tune `adaptive`, each with why it has its value.

The modules read them here at call time (`tuning.NAME`), so a test that patches one patches
this module.
"""

from __future__ import annotations

# What a placement costs (`policies.adaptive.candidates`, `policies.adaptive.scoring`).

# TTFT risk is 0 up to this share of the objective: a margin for the prediction's error.
RISK_FROM = 0.5
# A placement's TTFT at its objective weighs this many misses: speed only breaks near-ties.
TTFT_WEIGHT = 0.05
# GPU ms weigh this many TTFT ms: each is a ms the turns queued behind it on the worker wait.
WORK_WEIGHT = 16.0
# Misses a move off the resident worker must save: it moves load and cache the model omits.
SEPARATION_MARGIN = 0.05
# Where prefills are slow steps (the typical one past the ITL objective), the headroom a new
# session's answer leaves under that objective weighs this many misses (`TurnTerms.pace`):
# each stream keeps slow prefills off its worker for its life, so answers spread over workers
# free of streams leave fewer workers to prefill on. At TTFT_WEIGHT it lost to a first
# step a few ms shorter on the emptier worker, and a prefill-bound fleet (Mooncake) kept
# two decode workers where one served all its answers. (Returning sessions' answers keep the
# old weight: packing them too cost mixed-multi-turn 8% of its max goodput.)
PACKING_MISSES = 1.0
# ... and no headroom is credited where the answer's step passes this share of the ITL
# objective: a step near it risks every stream's gaps there (noise, longer contexts).
PACK_UP_TO = 0.5
# The least share of a link's rate a transfer gets, however full its ledger: H stays finite.
LINK_FLOOR_FRACTION = 0.01
# The busiest share of time prefills are taken to fill on a worker: step / (1 - u) stays finite.
UTILISATION_MAX = 0.9

# The slow steps and KV a stream meets (`policies.adaptive.ledgers.legs`).

# The ITL objective is on the p99 of a stream's gaps: 1% of them may be slow.
SLOW_GAP_SHARE = 0.01
# A slow step's harm weighs crossing a stream's allowance so, the budget it spends the rest:
# crossings alone pile prefills beside calm streams until all cross at once.
CROSSING_WEIGHT = 0.7
# KV usage from which a new stream risks preemption: the usage is an estimate, so before full.
KV_CROWDED_FROM = 0.8
# The misses of a full KV cache: the new stream waits for room, and a preempted one stalls.
KV_FULL_MISSES = 2.0
# vLLM's default --gpu-memory-utilization: the share of a GPU's memory its engine takes.
GPU_MEMORY_UTILIZATION = 0.9

# Admission and due times (`policies.adaptive.admission`).

# The share of turns continuing a session follows about the last 100 turns decided.
CONTINUING_RATE = 0.01
# Rejection waits at most this many objectives: its limit stays finite as every turn continues.
MAX_FACTOR = 20.0
# A served turn is due at most this many of the laxest fresh objective: a long session's late
# turn goes behind the fresh ones beside it, but not behind whole bursts of them.
DUE_CAP_FACTOR = 2.0
# With no outcome observed for this long, nothing of its own in flight and the best placement's
# workers idle, a turn predicted to miss is served, not rejected (`AdaptivePolicy._probe`):
# rejections report nothing, and estimates taught by an overload would otherwise reject
# every turn after the fleet recovered. Seconds, a few clients' retry intervals.
PROBE_AFTER_S = 5.0

# The fresh turns whose objectives and prefills set the due caps: recent, and many enough.
FRESH_WINDOW = 256
# A returning turn prefilling at most this many times a fresh turn's mean costs about as much.
LIGHT_FACTOR = 1.5

# What the ledgers keep (`policies.adaptive.ledgers`).

# Workers per ledger: past any fleet, so a flood of unknown worker ids cannot grow them.
MAX_TRACKED_WORKERS = 4096
# Requests per ledger (past it the oldest quarter goes): far past the turns in flight.
MAX_TRACKED_REQUESTS = 65536
# A request predicted done this long ago whose outcome never came (lost, a restart) is gone.
STALE_AFTER_S = 60.0
# Per worker, the placements `WorkLedger.settle` may find queued: past an engine's queue.
MAX_RECENT = 1024

# The decode-capable workers a turn's terms are computed on past its resident: the least
# loaded this many, where the shortlists pick from (a fleet this size or smaller is scored
# whole, as before).
SCREENED_WORKERS = 8

# On a fleet past `SCREENED_WORKERS`, how old the mean rate of the workers hosting slow
# prefills (`StallLedger.host_rate`: a pass over all of them) may be, in s; it moves at the
# stall window's pace (seconds).
HOST_RATE_FRESH_S = 0.05
