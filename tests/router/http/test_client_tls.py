"""TLS to https:// workers: the turns' pool (`UpstreamPool`) and the scraping session
(`WorkerPool.open_session`, aiohttp) against aiohttp servers on 127.0.0.1 with certificates made
here by the openssl command: a CA's, one it signs for the server and the client, and a rogue
CA's server certificate that verification must refuse."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import uvloop
from aiohttp import web

from router.config import ConfigError, RouterConfig, WorkerSpec
from router.fleet.tls import worker_ssl_context
from router.fleet.workers import WorkerPool
from router.http.client import UpstreamConnectError, UpstreamError, UpstreamPool

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(name: str, cwd: Path) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=cwd,
    )  # fmt: skip


def _leaf(name: str, ca: str, extensions: str, cwd: Path) -> None:
    (cwd / f"{name}.ext").write_text(
        extensions + "\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
        cwd=cwd,
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("certs")
    _ca("ca", cwd)
    _ca("rogue-ca", cwd)
    server = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"
    _leaf("server", "ca", server, cwd)
    _leaf("rogue-server", "rogue-ca", server, cwd)
    _leaf("router-client", "ca", "extendedKeyUsage=clientAuth", cwd)
    _leaf("elsewhere", "ca", "subjectAltName=DNS:worker.example\nextendedKeyUsage=serverAuth", cwd)
    return cwd


def _server_context(certs: Path, name: str = "server", client_ca: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs / f"{name}.pem", certs / f"{name}.key")
    if client_ca:  # mutual TLS: a client certificate signed by the CA is required
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(certs / "ca.pem")
    return context


async def _whoami(request: web.Request) -> web.Response:
    """Answers with the client certificate's common name ("-" when none was presented)."""
    peer = request.transport.get_extra_info("peercert") if request.transport else None
    subject = dict(pair[0] for pair in peer["subject"]) if peer else {}
    return web.Response(text=f"{request.path} {subject.get('commonName', '-')}")


Serve = Callable[[ssl.SSLContext], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def start(context: ssl.SSLContext) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", _whoami)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        cleanups.append(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
        return f"https://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for cleanup in cleanups:
        await cleanup()


def _config(certs: Path, url: str = "https://127.0.0.1:1", **options: object) -> RouterConfig:
    files = {key: str(certs / value) for key, value in options.items() if isinstance(value, str)}
    flags = {key: value for key, value in options.items() if isinstance(value, bool)}
    return RouterConfig(workers=(WorkerSpec(url=url),), **files, **flags)  # type: ignore[arg-type]


async def _get(pool: UpstreamPool, url: str, path: str = "/v1/models") -> bytes:
    async with asyncio.timeout(10):
        response = await pool.request(url, "GET", path, {})
        return await response.read()


async def test_pool_verifies_a_worker_by_the_configured_ca_and_reuses_the_connection(
    certs: Path, serve: Serve
) -> None:
    url = await serve(_server_context(certs))
    pool = UpstreamPool(ssl_context=worker_ssl_context(_config(certs, worker_ca_file="ca.pem")))
    try:
        assert await _get(pool, url) == b"/v1/models -"
        assert await _get(pool, url, "/again") == b"/again -"
        assert len(pool.connections) == 1  # kept alive over TLS
    finally:
        await pool.close()


async def test_pool_presents_the_client_certificate_to_a_worker_that_requires_one(
    certs: Path, serve: Serve
) -> None:
    url = await serve(_server_context(certs, client_ca=True))
    mutual = _config(
        certs,
        worker_ca_file="ca.pem",
        worker_cert_file="router-client.pem",
        worker_key_file="router-client.key",
    )
    pool = UpstreamPool(ssl_context=worker_ssl_context(mutual))
    anonymous = UpstreamPool(
        ssl_context=worker_ssl_context(_config(certs, worker_ca_file="ca.pem"))
    )
    try:
        assert await _get(pool, url) == b"/v1/models router-client"
        with pytest.raises(UpstreamError):  # refused in the handshake or right after it
            await _get(anonymous, url)
    finally:
        await pool.close()
        await anonymous.close()


async def test_pool_refuses_a_certificate_it_cannot_verify_unless_told_to_skip(
    certs: Path, serve: Serve
) -> None:
    url = await serve(_server_context(certs, "rogue-server"))
    verifying = UpstreamPool(
        ssl_context=worker_ssl_context(_config(certs, worker_ca_file="ca.pem"))
    )
    system_cas = UpstreamPool()  # https:// with no context: the system's CAs
    insecure = UpstreamPool(
        ssl_context=worker_ssl_context(_config(certs, worker_tls_insecure=True))
    )
    try:
        for pool in (verifying, system_cas):
            with pytest.raises(UpstreamConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await _get(pool, url)
        assert await _get(insecure, url) == b"/v1/models -"
    finally:
        for pool in (verifying, system_cas, insecure):
            await pool.close()


async def test_pool_checks_the_name_in_the_certificate(certs: Path, serve: Serve) -> None:
    url = await serve(_server_context(certs, "elsewhere"))  # the CA's, for worker.example
    pool = UpstreamPool(ssl_context=worker_ssl_context(_config(certs, worker_ca_file="ca.pem")))
    try:
        with pytest.raises(UpstreamConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await _get(pool, url)
    finally:
        await pool.close()


async def test_scraping_session_reaches_https_workers_with_the_same_context(
    certs: Path, serve: Serve
) -> None:
    url = await serve(_server_context(certs, client_ca=True))
    config = _config(
        certs, url, worker_ca_file="ca.pem", worker_cert_file="router-client.pem",
        worker_key_file="router-client.key",
    )  # fmt: skip
    workers = WorkerPool(config.workers, tls=worker_ssl_context(config))
    session = workers.open_session(connect_timeout_s=5)
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with session.get(url + "/metrics", timeout=timeout) as response:
            assert (response.status, await response.text()) == (200, "/metrics router-client")
        assert await _get(workers.upstream, url) == b"/v1/models router-client"
    finally:
        await workers.close()


def _smoke_uvloop(certs: Path) -> bytes:
    async def run() -> bytes:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", _whoami)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            context = _server_context(certs, client_ca=True)
            await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
            url = f"https://127.0.0.1:{runner.addresses[0][1]}"
            mutual = _config(
                certs, worker_ca_file="ca.pem", worker_cert_file="router-client.pem",
                worker_key_file="router-client.key",
            )  # fmt: skip
            pool = UpstreamPool(ssl_context=worker_ssl_context(mutual))
            try:
                return await _get(pool, url)
            finally:
                await pool.close()
        finally:
            await runner.cleanup()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run())


def test_pool_speaks_tls_on_uvloop_too(certs: Path) -> None:
    assert _smoke_uvloop(certs) == b"/v1/models router-client"


@pytest.fixture
def bad_files(certs: Path) -> Iterator[Path]:
    (certs / "not-a-cert.pem").write_text("nothing here\n")
    yield certs


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"worker_ca_file": "missing.pem"}, "worker_ca_file"),
        ({"worker_ca_file": "not-a-cert.pem"}, "worker_ca_file"),
        ({"worker_cert_file": "router-client.pem"}, "client certificate"),  # no key in it
        ({"worker_cert_file": "not-a-cert.pem", "worker_key_file": "server.key"}, "client"),
    ],
)
def test_unusable_tls_files_are_refused_at_start(
    bad_files: Path, options: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        worker_ssl_context(_config(bad_files, **options))


def test_plain_http_fleets_need_no_tls_context(certs: Path) -> None:
    assert worker_ssl_context(_config(certs, "http://127.0.0.1:1")) is None
    context = worker_ssl_context(_config(certs))  # an https:// worker: the system's CAs
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
