"""Waiting on a URL without a process to watch: only the deadline ends it, with one line naming the URL."""

from __future__ import annotations

import time

import pytest

from prunewatch.services import ServiceError, free_port, wait_for_url


def test_waiting_on_a_url_nobody_answers_fails_at_the_deadline():
    url = f"http://127.0.0.1:{free_port()}/-/ready"
    started = time.monotonic()
    with pytest.raises(ServiceError, match=f"{url} did not answer within 0.5s"):
        wait_for_url(url, 0.5, poll_s=0.05)
    assert time.monotonic() - started < 5
