"""Local server processes (PostgreSQL, Prometheus, Alertmanager) on 127.0.0.1 for the stack, tests, benchmarks."""

from prunewatch.services._binaries import (
    ALERTMANAGER_BINARIES,
    PROMETHEUS_BINARIES,
    PUSHGATEWAY_BINARIES,
    find_binary,
    which_binary,
)
from prunewatch.services._postgres import (
    LocalPostgres,
    PostgresServer,
    postgres_available,
    postgres_bin,
    postgres_bin_dirs,
    postgres_version,
    temporary_postgres,
)
from prunewatch.services._processes import (
    ProcessRecord,
    ServiceError,
    free_port,
    group_members,
    http_ok,
    is_running,
    last_log_line,
    launch,
    stop,
    wait_for_http,
    wait_for_url,
    wait_until,
)

__all__ = [
    "ALERTMANAGER_BINARIES",
    "PROMETHEUS_BINARIES",
    "PUSHGATEWAY_BINARIES",
    "LocalPostgres",
    "PostgresServer",
    "ProcessRecord",
    "ServiceError",
    "find_binary",
    "free_port",
    "group_members",
    "http_ok",
    "is_running",
    "last_log_line",
    "launch",
    "postgres_available",
    "postgres_bin",
    "postgres_bin_dirs",
    "postgres_version",
    "stop",
    "temporary_postgres",
    "wait_for_http",
    "wait_for_url",
    "wait_until",
    "which_binary",
]
