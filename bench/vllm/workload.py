"""A multi-turn workload that fits the tiny model: the live bench's trace on real engines.

The tiny model's context is 4,096 tokens and its tokenizer gives about 2.6 tokens per word of
the replay's synthetic vocabulary, so sessions stay under about 1,300 words of context: three
turns of 128 or 384 new words answered with 16 or 48 tokens, Poisson session starts.

    .venv/bin/python -m bench.vllm.workload --out bench-out/real/trace.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec

from bench.traces.workloads import ArrivalSpec, ThinkSpec, WorkloadSpec, generate_matrix

TINY_MULTI_TURN = WorkloadSpec(
    name="tiny-multi-turn",
    prompt_tokens=(128, 384),
    output_tokens=(16, 48),
    reuse=("multi-turn",),
    turns=(3,),
    sessions_per_class=25,
    arrival=ArrivalSpec(process="poisson", rate_rps=1.0),
    think=ThinkSpec(distribution="exponential", mean_s=1.0),
    block_tokens=128,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.vllm.workload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="the native trace to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessions-per-class", type=int, default=None)
    args = parser.parse_args(argv)
    spec = msgspec.structs.replace(TINY_MULTI_TURN, seed=args.seed)
    if args.sessions_per_class is not None:
        spec = msgspec.structs.replace(spec, sessions_per_class=args.sessions_per_class)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    trace = generate_matrix(spec, args.out)
    turns = sum(len(c.turns) for c in trace.conversations)
    print(f"{len(trace.conversations)} sessions, {turns} turns written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
