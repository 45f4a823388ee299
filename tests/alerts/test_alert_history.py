"""The evaluator's incremental window over the store: new, late and expired results."""

from __future__ import annotations

from datetime import timedelta

from prunewatch.alerts.history import StoreHistory
from tests.alerts.conftest import T0, result, store_results


def ids(results) -> list[str]:
    return [r.probe_id for r in results]


def test_window_follows_the_store_incrementally(store) -> None:
    history = StoreHistory(store, horizon=timedelta(minutes=30), late=timedelta(minutes=5),
                           full_every=timedelta(minutes=10))
    store_results(store, [result(T0, "legal", "a"), result(T0 + timedelta(minutes=1), "legal", "b")])
    assert ids(history.results(T0 + timedelta(minutes=1))) == ["a", "b"]  # the instant itself is included

    store_results(store, [result(T0 + timedelta(minutes=2), "legal", "c"),
                          result(T0 - timedelta(seconds=30), "legal", "late-but-in-overlap")])
    assert ids(history.results(T0 + timedelta(minutes=3))) == ["late-but-in-overlap", "a", "b", "c"]

    store_results(store, [result(T0 - timedelta(minutes=10), "legal", "buffered-long")])
    assert "buffered-long" not in ids(history.results(T0 + timedelta(minutes=4)))  # outside the overlap...
    assert "buffered-long" in ids(history.results(T0 + timedelta(minutes=11)))  # ...until the periodic reload

    later = history.results(T0 + timedelta(minutes=31))
    assert ids(later) == ["b", "c"]  # a and the older ones left the 30 minute horizon
