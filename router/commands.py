"""`session-router serve`: the router in front of real or simulated workers."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
from typing import Any

from router import native
from router.config import ConfigError, RouterConfig, add_serve_options, load_config


async def serve(config: RouterConfig, announce: bool = True) -> None:
    """Run one router replica until SIGINT or SIGTERM; turns in flight finish first."""
    from router.app import Router
    from router.http import HttpServer

    router = Router(config)
    await router.start()
    gc.freeze()  # what start-up built lives as long as the process: keep it out of collections
    server = HttpServer(
        router.handle,
        max_body_bytes=config.max_body_bytes,
        keepalive_timeout_s=config.keepalive_timeout_s,
        read_timeout_s=config.client_read_timeout_s,
        max_connections=config.max_connections,
        max_requests_per_connection=config.keepalive_requests,
    )
    try:
        await server.start(config.host, config.port)
        if announce:
            workers = ", ".join(f"{w.worker_id} ({w.role})" for w in config.workers)
            if config.discovery != "static":
                workers += f" + {config.discovery} discovery"
            print(
                f"session-router listening on http://{config.host}:{config.port} "
                f"policy={config.policy.name} redis={config.redis} "
                f"native={'on' if native.active else 'off'} workers: {workers}",
                flush=True,
            )
            logging.getLogger("router").info("compiled hot path %s", native.status)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        loop.add_signal_handler(signal.SIGHUP, router.reload)  # discovery looks again
        await stop.wait()
    finally:
        await server.close(grace_s=10.0)
        await router.stop()


def _run_serve(args: argparse.Namespace) -> int:
    import uvloop

    try:
        config = load_config(args)
    except (ConfigError, ValueError) as exc:
        raise SystemExit(f"session-router serve: {exc}") from exc
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        uvloop.run(serve(config))
    except ValueError as exc:  # e.g. a policy parameter typo found at start-up
        raise SystemExit(f"session-router serve: {exc}") from exc
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="run the router (OpenAI-compatible endpoint in front of workers)",
        description="Session-aware router in front of vLLM / SGLang prefill and decode workers.",
    )  # fmt: skip
    add_serve_options(parser)
    parser.set_defaults(run=_run_serve)
    native.register(subparsers)
