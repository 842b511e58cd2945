"""`session-router sim-worker` and `session-router sim-cluster`."""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

from sim.engine.engine import EngineConfig
from sim.engine.presets import GPUS, MODELS, deployment_from_names
from sim.worker.server import VLLM_VERSIONS, WorkerOptions

STEP_TIMER_SWITCH_INTERVAL_S = 0.0002


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that starts simulated workers."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--gpu", default="h200-sxm", choices=sorted(GPUS))
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument(
        "--block-size", type=int, default=16, help="as vLLM's: tokens per KV-cache block"
    )
    parser.add_argument(
        "--chunked-prefill", type=int, default=None, metavar="N",
        help="prefill at most N tokens of a request per step (default: whole prompts)",
    )  # fmt: skip
    parser.add_argument("--nic-gbps", type=float, default=400.0, help="NIC bandwidth, Gb/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--num-gpu-blocks-override", type=int, default=None, metavar="N",
        help="as vLLM's: a KV cache of N blocks in place of what the GPU's memory holds",
    )  # fmt: skip
    parser.add_argument("--noise", type=float, default=0.02, help="step-time noise sigma")
    parser.add_argument("--eos-probability", type=float, default=0.0)
    parser.add_argument(
        "--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
        help="as vLLM's: priority admits requests with the lowest `priority` value first",
    )  # fmt: skip
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--vllm-version", choices=VLLM_VERSIONS, default="0.32",
        help="the vLLM whose wire to speak: 0.32 as observed, or legacy (priority refused "
        "without priority scheduling, flat remote_block_ids, pulled KV counted as cached)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-hold-timeout-s", type=float, default=480.0,
        help="free a prefill leg's held KV blocks after this long if never pulled",
    )  # fmt: skip


def worker_options(args: argparse.Namespace, port: int) -> WorkerOptions:
    try:
        engine = EngineConfig(
            deployment=deployment_from_names(args.gpu, args.model, args.tp, args.block_size),
            seed=args.seed,
            noise_sigma=args.noise,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            chunked_prefill=args.chunked_prefill,
            eos_probability=args.eos_probability,
            max_model_len=args.max_model_len,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            scheduling_policy=args.scheduling_policy,
        )
    except ValueError as exc:
        raise SystemExit(f"session-router: {exc}") from exc
    return WorkerOptions(
        engine=engine,
        host=args.host,
        port=port,
        served_model_name=args.served_model_name,
        nic_gbps=args.nic_gbps,
        held_timeout_s=args.kv_hold_timeout_s,
        vllm_version=args.vllm_version,
    )


def _run_worker(args: argparse.Namespace) -> int:
    return _serve(args, count=1, base_port=args.port)


def _run_cluster(args: argparse.Namespace) -> int:
    return _serve(args, count=args.workers, base_port=args.base_port, spine=args.spine_gbps)


def _serve(args: argparse.Namespace, count: int, base_port: int, spine: Any = None) -> int:
    import uvloop

    from sim.cluster import SimCluster, serve_until_signalled

    template = worker_options(args, base_port)
    if count < 1:
        raise SystemExit("session-router: --workers must be at least 1")

    async def main() -> None:
        cluster = SimCluster.uniform(template, count, base_port, spine)
        # The engines' block tables are big long-lived containers: a full collection that
        # walks them stalls every stream of every worker in this process for ~13 ms.
        gc.freeze()
        # The precise step timer's thread needs the GIL to hand a wake-up to the loop; with
        # the default 5 ms switch interval a busy loop kept it waiting for up to 5 ms, and
        # that lag went into the streams' inter-token gaps (p99 ~5 ms -> ~2 ms measured).
        sys.setswitchinterval(STEP_TIMER_SWITCH_INTERVAL_S)
        await serve_until_signalled(cluster)

    uvloop.run(main())
    return 0


def register(subparsers: Any) -> None:
    worker = subparsers.add_parser(
        "sim-worker", help="run one simulated vLLM-compatible GPU worker",
        description="A simulated vLLM worker: same HTTP API, P/D fields and metrics.",
    )  # fmt: skip
    worker.add_argument("--port", type=int, default=8101)
    add_worker_options(worker)
    worker.set_defaults(run=_run_worker)

    cluster = subparsers.add_parser(
        "sim-cluster", help="run several simulated workers in one process on a shared fabric",
        description="Simulated workers on consecutive ports sharing one modelled fabric.",
    )  # fmt: skip
    cluster.add_argument("--base-port", type=int, default=8101)
    cluster.add_argument("--workers", type=int, default=4)
    cluster.add_argument(
        "--spine-gbps", type=float, default=None,
        help="a shared spine all transfers cross (default: none, only NICs limit)",
    )  # fmt: skip
    add_worker_options(cluster)
    cluster.set_defaults(run=_run_cluster)
