"""TLS to https:// workers: one client context for the turns' pool and the scraping session.

Verification is on unless `worker_tls_insecure` says otherwise: against `worker_ca_file` when
given, else the system's CAs, with the certificate's names checked against the worker URL's
host (an IP address against its IP SANs). `worker_cert_file` (with `worker_key_file`, unless
the key is in the same file) is presented to workers that ask for a client certificate.
"""

from __future__ import annotations

import ssl
from urllib.parse import urlsplit

from router.config import ConfigError, RouterConfig


def uses_tls(config: RouterConfig) -> bool:
    """Some worker is https://, or a TLS option is set (so its files are checked at start)."""
    return any(urlsplit(worker.url).scheme == "https" for worker in config.workers) or bool(
        config.worker_ca_file
        or config.worker_cert_file
        or config.worker_key_file
        or config.worker_tls_insecure
    )


def worker_ssl_context(config: RouterConfig) -> ssl.SSLContext | None:
    """The client context for https:// workers, None where TLS is not used at all; a file that
    cannot be read or does not hold what it should raises ConfigError."""
    if not uses_tls(config):
        return None
    try:
        context = ssl.create_default_context(cafile=config.worker_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"worker_ca_file {config.worker_ca_file!r}: {exc}") from exc
    if config.worker_tls_insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if config.worker_cert_file:
        try:
            context.load_cert_chain(config.worker_cert_file, config.worker_key_file)
        except (OSError, ssl.SSLError) as exc:
            files = config.worker_cert_file + (
                f", {config.worker_key_file}" if config.worker_key_file else ""
            )
            raise ConfigError(f"worker client certificate ({files}): {exc}") from exc
    return context
