"""What a transfer over one link exposes to the turn waiting for it, from the link ledger
(a part of `policies.adaptive.scoring`'s H term, apart from the per-turn state)."""

from __future__ import annotations

import math

from policies.types import LinkView

# The least share of a link's rate a transfer is assumed to get, however full the ledger.
LINK_FLOOR_FRACTION = 0.01


def exposed_transfer_ms(
    link: LinkView | None,
    measured_bps: float | None,
    default_bps: float,
    horizon_s: float,
    nbytes: int,
    start_ms: float = 0.0,
) -> float:
    """Time to move `nbytes` over `link` starting `start_ms` from now, given what its ledger
    holds: the bytes in flight and reserved drain at the link's rate meanwhile (a handoff
    queued behind long prefills reserves its bytes long before it sends them). The rate is
    the link's capacity (else its observed rate, else `default_bps`), capped by the rate
    measured on it (`measured_bps`); without a link in the view, the measured or default
    rate alone."""
    if nbytes <= 0:
        return 0.0
    if link is None:
        return nbytes * 1000.0 / (measured_bps if measured_bps is not None else default_bps)
    rate = link.capacity_bps if link.capacity_bps > 0.0 else link.observed_bps
    rate = rate if rate > 0.0 else default_bps
    if measured_bps is not None and measured_bps < rate:
        rate = measured_bps
    sending = link.bytes_in_flight if link.bytes_in_flight > 0 else 0
    reserved = link.reserved_bytes if link.reserved_bytes > 0 else 0
    pending = sending + reserved - rate * start_ms / 1000.0
    available = rate - pending / horizon_s if pending > 0.0 else rate
    floor = rate * LINK_FLOOR_FRACTION
    available = available if available > floor else floor
    latency_s = link.latency_s if 0.0 < link.latency_s < math.inf else 0.0
    return (latency_s + nbytes / available) * 1000.0
