"""A minimal W3C WebDriver client for Debian's chromedriver + headless chromium, over plain HTTP (httpx).

Enough to open a page, wait for client-side rendering, read the DOM text and take a screenshot;
no browser download and no extra Python package.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.servers import free_port, wait_for_http

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def browser_available() -> bool:
    return Path(CHROMIUM).is_file() and shutil.which(CHROMEDRIVER) is not None


class Browser:
    """One WebDriver session."""

    def __init__(self, base: str, session_id: str) -> None:
        self.base = f"{base}/session/{session_id}"

    def _post(self, path: str, payload: dict) -> object:
        response = httpx.post(f"{self.base}/{path}", json=payload, timeout=60)
        response.raise_for_status()
        return response.json()["value"]

    def open(self, url: str) -> None:
        self._post("url", {"url": url})

    def script(self, source: str) -> object:
        return self._post("execute/sync", {"script": source, "args": []})

    def wait_for_text(self, needles: list[str], timeout_s: float) -> str:
        """Poll the rendered page's text until every needle is present; returns that text."""
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = str(self.script("return document.body ? document.body.innerText : ''"))
            if all(needle in text for needle in needles):
                return text
            time.sleep(0.25)
        missing = [n for n in needles if n not in text]
        raise TimeoutError(f"page did not show {missing} within {timeout_s}s; it showed: {text[:500]!r}")

    def wait_until(self, condition_js: str, timeout_s: float) -> None:
        """Poll a JavaScript expression (a `return ...` body) until it is true."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.script(condition_js) is True:
                return
            time.sleep(0.25)
        raise TimeoutError(f"condition not met within {timeout_s}s: {condition_js.strip()[:200]}")

    def screenshot(self, path: Path) -> bytes:
        response = httpx.get(f"{self.base}/screenshot", timeout=60)
        response.raise_for_status()
        png = base64.b64decode(response.json()["value"])
        path.write_bytes(png)
        return png


@contextmanager
def headless_chromium(width: int = 1400, height: int = 2400) -> Iterator[Browser]:
    """chromedriver on a free 127.0.0.1 port driving headless chromium with a throwaway profile."""
    port = free_port()
    profile = tempfile.mkdtemp(prefix="prunewatch-chromium-")
    driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    session_id = None
    try:
        wait_for_http(f"{base}/status", timeout_s=30)
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--window-size={width},{height}"]
        capabilities = {"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "goog:chromeOptions": {"binary": CHROMIUM, "args": args}}}}
        response = httpx.post(f"{base}/session", json=capabilities, timeout=90)
        response.raise_for_status()
        session_id = response.json()["value"]["sessionId"]
        yield Browser(base, session_id)
    finally:
        if session_id is not None:
            try:
                httpx.delete(f"{base}/session/{session_id}", timeout=30)
            except httpx.HTTPError:
                pass
        driver.terminate()
        try:
            driver.wait(10)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait(10)
        shutil.rmtree(profile, ignore_errors=True)
