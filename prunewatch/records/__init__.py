"""Records: the contracts every part shares — the probe result, its metric families and PromQL, the store.

Plain data and SQL only: importing records (except prunewatch.records.engine_stats) loads neither the engine
nor torch, so the ROI app, alerts and dashboards read results cheaply.
"""
