"""Fast-forwarding an engine's steady decode: many steps drawn at once, applied on demand.

When every running request decodes one token per step and nothing waits
(`Engine.steady_decode`), the batch stays the same from step to step until a request
finishes, a request arrives, a block cannot be allocated or a held prefill leg expires. Until
then each step's duration depends only on the context sum, which grows by the batch size per
step, and on the engine's next noise draw, so the end times of those steps can be drawn in
advance (`DecodeRun.plan`). The caller lets time pass and applies the steps that ended
(`advance`) before anything reads or changes the engine; the run replays the steps' KV block
allocations and registrations in the order the step-by-step engine makes them, and the
tokens are the same word generator's, so the engine's state is exactly the step-by-step one.
A run that must end early (a request arrives) hands its unused noise draws back (`truncate`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING

from sim.engine.kvcache import extend_block_hashes
from sim.engine.requests import SeqState
from sim.worker.tokenizer import WordGenerator

if TYPE_CHECKING:
    from sim.engine.engine import Engine

_words_at = WordGenerator.token_ids_at

# What `advance` produced: the steps' end times, and each request's tokens in those steps.
Delivery = tuple[list[float], list[tuple[str, list[int]]]]


class DecodeRun:
    """Steps 1..`steps` of a steady batch whose step 1 is in flight (begun, not finished).

    Steps up to `steps - 1` are applied by `advance`, each ending at `ends[k - 1]`; the last
    one is left in flight for the caller's ordinary `finish_step` at `ends[-1]`, since it is
    where something changes (a request finishes, or the next step needs a block that is not
    free, or a held leg's deadline has passed).
    """

    __slots__ = ("_base", "_blocks", "_cursor", "_factors", "applied", "ends", "engine", "seqs",
                 "steps")  # fmt: skip

    def __init__(
        self, engine: Engine, seqs: list[SeqState], ends: list[float], factors: list[float],
        blocks: list[tuple[int, int, int]],
    ) -> None:  # fmt: skip
        self.engine = engine
        self.seqs = seqs
        self.ends = ends
        self.steps = len(ends)
        self.applied = 0  # steps finished so far (step `applied + 1` is in flight)
        self._factors = factors  # noise factors of steps 2..steps
        self._blocks = blocks  # (step, 0 register | 1 allocate, seq index), in order
        self._cursor = 0
        self._base = [len(s.tokens) - 1 for s in seqs]  # computed tokens before step 1

    @classmethod
    def plan(cls, engine: Engine, first_end: float, max_steps: int) -> DecodeRun | None:
        """The run from the engine's frozen step (steady, ending at `first_end`), or None if
        fewer than two steps would fit in it."""
        seqs = list(engine.running)
        steps = min(min(s.max_tokens - s.generated for s in seqs), max_steps)
        if steps < 2:
            return None
        blocks = engine.blocks
        bs = blocks.block_size
        # Step k (k >= 2) begins by allocating a block for each request whose next token
        # starts one; a registration follows each finish that completes a block.
        events: list[tuple[int, int, int]] = []
        allocations: list[int] = []
        for i, seq in enumerate(seqs):
            n = len(seq.tokens)
            first = len(seq.block_ids) * bs - n + 2
            allocations += range(first, steps + 1, bs)
            events += [(k - 1, 1, i) for k in range(first, steps + 1, bs)]
            if blocks.enable_prefix_caching:
                first = (1 - n) % bs or bs
                events += [(k, 0, i) for k in range(first, steps, bs)]
        free = blocks.num_free_blocks
        if len(allocations) > free:  # the step that lacks a block begins step by step
            allocations.sort()
            steps = allocations[free] - 1
            if steps < 2:
                return None
        cost = engine.cost_model
        factors = cost.noise_factors(steps - 1)
        context = sum(len(s.tokens) for s in seqs) + len(seqs)  # step 2's
        ends = cost.decode_step_ends(len(seqs), context, first_end, factors)
        ends.insert(0, first_end)
        if engine.num_held:
            deadline = engine.next_held_deadline()
            # Expiring holds as a step begins frees blocks: that step begins step by step.
            fits = steps if deadline is None else bisect_left(ends, deadline) + 1
            if fits < steps:
                cost.unread(factors[fits - 1 :])
                del factors[fits - 1 :], ends[fits:]
                steps = fits
                if steps < 2:
                    return None
        events = [e for e in events if e[0] < steps]
        events.sort()
        return cls(engine, seqs, ends, factors, events)

    def steps_by(self, now: float) -> int:
        """How many steps have ended by `now` that `advance` may apply (not the last)."""
        return bisect_right(self.ends, now, 0, self.steps - 1)

    def advance(self, upto: int) -> Delivery | None:
        """Finish steps `applied + 1`..`upto` (< `steps`) and begin the step after each."""
        done = self.applied
        count = upto - done
        if count <= 0:
            return None
        self.applied = upto
        engine = self.engine
        delivered: list[tuple[str, list[int]]] = []
        for seq in self.seqs:
            g = seq.generated
            upcoming = seq.upcoming
            if len(upcoming) >= count:
                new = upcoming[len(upcoming) - count :]
                del upcoming[len(upcoming) - count :]
                new.reverse()
            else:
                new = upcoming[::-1]
                new += _words_at(seq.key, g + len(new), count - len(new))
                upcoming.clear()
            seq.tokens += new
            seq.generated = g + count
            seq.num_computed += count
            delivered.append((seq.request_id, new))
        engine.generation_tokens_total += count * len(self.seqs)
        events = self._blocks
        i = self._cursor
        if i < len(events) and events[i][0] <= upto:
            blocks = engine.blocks
            bs = blocks.block_size
            seqs, base = self.seqs, self._base
            while i < len(events) and events[i][0] <= upto:
                step, allocate, s = events[i]
                seq = seqs[s]
                if allocate:
                    block = blocks.allocate_one()
                    if block is None:
                        raise RuntimeError("a planned decode step found no free block")
                    seq.block_ids.append(block)
                else:
                    full = (base[s] + step) // bs
                    if len(seq.hashes) < full:
                        extend_block_hashes(seq.tokens, seq.hashes, bs, full)
                    blocks.register_blocks(seq.block_ids, seq.hashes, full - 1, full)
                i += 1
            self._cursor = i
        return self.ends[done:upto], delivered

    def kv_usage(self, upto: int) -> float:
        """The engine's KV usage once `advance(upto)` ran, without running it: each planned
        allocation takes one free block."""
        blocks = self.engine.blocks
        events = self._blocks
        taken = 0
        i = self._cursor
        while i < len(events) and events[i][0] <= upto:
            taken += events[i][1]
            i += 1
        return (blocks.num_blocks - blocks.num_free_blocks + taken) / blocks.num_blocks

    def truncate(self) -> float:
        """End the run after the step in flight (step `applied + 1`), which then finishes
        step by step: hand the later steps' noise draws back; that step's end time."""
        kept = self.applied  # factors of steps 2..applied + 1
        self.engine.cost_model.unread(self._factors[kept:])
        del self._factors[kept:]
        self.steps = self.applied + 1
        return self.ends[self.applied]
