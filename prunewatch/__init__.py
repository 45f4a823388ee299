"""prunewatch: observability and cost governance for pruned LLM inference (command line)."""

__version__ = "0.1.0"
