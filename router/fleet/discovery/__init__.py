"""Worker discovery: where the fleet's workers come from besides the static configuration.

One module per source, each a `Source` (`source.py`) that reports the whole set of workers it
sees whenever it changes: `file.py` (a watched TOML file of [[workers]]), `dns.py` (a headless
Service's A/AAAA records), `kubernetes.py` (pods by namespace and label selector, list and
watch). `router.fleet.membership` applies the sets to the pool. `source_of` builds the source
the configuration names.
"""

from __future__ import annotations

from router.config import ConfigError, RouterConfig
from router.fleet.discovery.source import Source, WorkerDefaults


def source_of(config: RouterConfig) -> Source | None:
    """The configured discovery source, None for `static` (ConfigError where the
    environment lacks what the source needs, e.g. the in-cluster API address)."""
    defaults = WorkerDefaults.of(config)
    kind = config.discovery
    if kind == "static":
        return None
    if kind == "file":
        from router.fleet.discovery.file import FileSource

        assert config.discovery_file is not None  # RouterConfig checks
        return FileSource(config.discovery_file, config.discovery_interval_s, defaults)
    if kind == "dns":
        from router.fleet.discovery.dns import DnsSource

        assert config.discovery_dns_name is not None
        return DnsSource(config.discovery_dns_name, defaults, config.discovery_interval_s,
                         server=config.discovery_dns_server)  # fmt: skip
    if kind == "kubernetes":
        from router.fleet.discovery.kubernetes import KubernetesSource

        return KubernetesSource.of(config, defaults)
    raise ConfigError(f"unknown discovery {kind!r}")


__all__ = ["Source", "WorkerDefaults", "source_of"]
