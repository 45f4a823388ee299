"""Optional push of the collector's registry to a Prometheus Pushgateway, for short-lived runs.

A `prunewatch collect --rounds 1` from cron ends before Prometheus scrapes it; pushing after each
round (and once at exit) keeps its samples. The push replaces the group (HTTP PUT), so the
gateway always holds this collector's latest state. A failed push is logged and never fatal.
"""

from __future__ import annotations

import logging
import socket

from prometheus_client import CollectorRegistry, push_to_gateway

logger = logging.getLogger("prunewatch.collector")


class Pushgateway:
    """Pushes one registry under job=`job`, instance=`instance` (default: this host's name)."""

    def __init__(self, url: str, registry: CollectorRegistry, *, job: str = "prunewatch_collector",
                 instance: str | None = None, timeout_s: float = 5.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"pushgateway URL must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.registry = registry
        self.job = job
        self.grouping_key = {"instance": instance or socket.gethostname()}
        self.timeout_s = timeout_s
        self.failures = 0

    def push(self) -> bool:
        """Push now; returns whether the gateway accepted it."""
        try:
            push_to_gateway(self.url, job=self.job, registry=self.registry, grouping_key=self.grouping_key,
                            timeout=self.timeout_s)
        except OSError as exc:  # URLError, connection refused, timeouts, HTTP errors
            self.failures += 1
            logger.warning("push to the Pushgateway %s failed: %s", self.url, exc)
            return False
        return True
