"""The X-Pruning-* / X-Prunewatch-* header names: the HTTP contract between an engine and its clients.

Written once here, read by the server (prunewatch/server/pruning_headers.py) and by the collector's
HTTP target (prunewatch/collector/http_target.py). No imports: a client needs the names, not the server.
"""

from __future__ import annotations

# -- request: per-request pruning controls ------------------------------------------------------
SENSITIVITY = "X-Pruning-Sensitivity"  # 0..1; 0 runs the dense model
LOG_LEVEL = "X-Pruning-Log-Level"  # NONE, SUMMARY or DETAILED
BLACKLIST = "X-Pruning-Blacklist"  # comma-separated layer indices never pruned
QUALITY = "X-Pruning-Quality"  # on / full / off: score the served answer against the dense model

# -- response: what pruning did and what it cost ------------------------------------------------
RATIO = "X-Pruning-Ratio"
STATS = "X-Pruning-Stats"  # key=value pairs, see STATS_KEYS
REQUEST_ID = "X-Prunewatch-Request-Id"
PREPROCESSING_MS = "X-Prunewatch-Preprocessing-Ms"
INFERENCE_MS = "X-Prunewatch-Inference-Ms"
POSTPROCESSING_MS = "X-Prunewatch-Postprocessing-Ms"
QUALITY_MS = "X-Prunewatch-Quality-Ms"
QUEUE_MS = "X-Prunewatch-Queue-Ms"

STATS_KEYS = ("layers_bypassed", "heads_gated", "sparsity", "total_tokens", "prefill_ratio", "decode_ratio",
              "agreement", "nll", "continuation_agreement", "ppl_delta_pct")
"""Keys of X-Pruning-Stats, in the order the server writes them: agreement and nll only when quality was scored
(the served answer against the dense model), the last two only after a full check."""
