"""The collector: runs canonical probes against engines on a schedule and records every result.

Import from its modules (prunewatch.collector.fleet, prunewatch.collector.targets, ...): a package-level surface would load the
engine and torch for every command that only reads the collector's settings.
"""
