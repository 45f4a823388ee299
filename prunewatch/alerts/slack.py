"""Slack incoming-webhook messages for alert transitions, posted with bounded retries.

The message reads like Alertmanager's (prunewatch/alerts/alertmanager.yml): the same title and text for one
alert, so a team sees one format whether Prometheus or the embedded evaluator raised it.
Retries: connection errors, 429 (honouring Retry-After, capped) and 5xx are retried with
doubling delays; other 4xx mean the webhook or the payload is wrong and are not retried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from prunewatch.alerts.evaluator import Transition

logger = logging.getLogger("prunewatch.alerts")


def slack_title(status: str, labels: dict[str, str], firing_count: int = 1) -> str:
    """`[FIRING:1] Name (severity) on model/domain at target`, as alertmanager.yml's title template writes it."""
    head = f"[{status.upper()}:{firing_count}]" if status == "firing" else f"[{status.upper()}]"
    title = f"{head} {labels.get('alertname', '')} ({labels.get('severity', '')})"
    if labels.get("model"):
        title += f" on {labels['model']}/{labels.get('domain', '')}"
    if labels.get("target"):
        title += f" at {labels['target']}"
    return title


def slack_text(annotations: dict[str, str]) -> str:
    """Summary, description and runbook of one alert, as alertmanager.yml's text template writes them."""
    return (f"*{annotations.get('summary', '')}*\n{annotations.get('description', '')}\n"
            f"Runbook: {annotations.get('runbook', '')}\n")


def slack_payload(transition: Transition) -> dict[str, Any]:
    """The JSON body of one incoming-webhook post for `transition`."""
    alert = transition.alert
    labels = dict(alert.labels)
    title = slack_title(transition.kind, labels)
    footer = (f"prunewatch embedded evaluator; active since {alert.active_at:%Y-%m-%d %H:%M:%S} UTC, "
              f"{transition.kind} at {transition.at:%Y-%m-%d %H:%M:%S} UTC")
    return {"text": title, "attachments": [{
        "color": "danger" if transition.kind == "firing" else "good", "title": title,
        "text": slack_text(alert.annotations), "fallback": title, "footer": footer, "mrkdwn_in": ["text"]}]}


@dataclass(frozen=True)
class PostOutcome:
    delivered: bool
    attempts: int
    retryable: bool
    detail: str


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    backoff_s: float = 1.0
    backoff_max_s: float = 8.0
    timeout_s: float = 5.0


class SlackWebhook:
    """Posts JSON to an incoming-webhook URL; the URL is fetched per post so a rotated secret file is picked up."""

    def __init__(self, url: Callable[[], str], policy: RetryPolicy, *,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        self._url = url
        self.policy = policy
        self._sleep = sleep
        self._clock = clock

    def post(self, payload: dict[str, Any], deadline: float) -> PostOutcome:
        """Try up to `policy.attempts` times, never sleeping past `deadline` (a `clock()` value)."""
        delay = self.policy.backoff_s
        detail = "not attempted"
        attempt = 0
        try:
            url = self._url()
        except OSError as exc:
            return PostOutcome(False, 0, True, f"cannot read the webhook URL: {exc.strerror or exc}")
        with httpx.Client(timeout=self.policy.timeout_s) as client:
            while attempt < self.policy.attempts:
                attempt += 1
                wait = delay
                try:
                    response = client.post(url, json=payload)
                except httpx.HTTPError as exc:
                    detail = f"{type(exc).__name__}: {exc}".splitlines()[0]
                else:
                    if 200 <= response.status_code < 300:
                        return PostOutcome(True, attempt, False, f"HTTP {response.status_code}")
                    detail = f"HTTP {response.status_code}: {response.text.strip()[:200]}"
                    if response.status_code == 429:
                        wait = max(delay, _retry_after(response))
                    elif response.status_code < 500:
                        return PostOutcome(False, attempt, False, detail)
                wait = min(wait, self.policy.backoff_max_s)
                if attempt >= self.policy.attempts or self._clock() + wait > deadline:
                    break
                logger.info("slack post failed (%s); retry %d in %.2fs", detail, attempt, wait)
                self._sleep(wait)
                delay = min(delay * 2, self.policy.backoff_max_s)
        return PostOutcome(False, attempt, True, detail)


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(0.0, float(response.headers.get("Retry-After", "0")))
    except ValueError:
        return 0.0
