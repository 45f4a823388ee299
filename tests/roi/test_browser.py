"""`prunewatch roi` really serves the app: headless Chromium renders the headline and every input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prunewatch.roi import Assumptions, Basis, calculate
from prunewatch.roi.app import current_window
from prunewatch.roi.settings import PASSWORD_ENV
from prunewatch.roi.store import load_results
from prunewatch.roi.tables import headlines
from tests.roi.webdriver import browser_available, headless_chromium
from tests.support.servers import free_port, wait_for_http

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = "import typer; from prunewatch.commands.roi import roi_command; typer.run(roi_command)"
# Streamlit renders client-side and lazily: wait until no skeleton is left, every Vega chart has drawn
# its marks and the inputs table has cells, so the screenshot shows the finished page.
RENDERED = """
const charts = [...document.querySelectorAll('[data-testid="stVegaLiteChart"]')];
return document.querySelectorAll('[data-testid="stSkeleton"]').length === 0
    && charts.length >= 4 && charts.every(c => c.querySelectorAll('svg.marks [class*="mark-"]').length > 0)
    && [...document.querySelectorAll('[data-testid="stDataFrame"] td')].some(td => td.innerText === 'Request volume');
"""  # the inputs table renders after the cost table: wait for the inputs table itself


@pytest.mark.integration
@pytest.mark.slow
def test_roi_command_serves_an_app_that_renders_in_chromium(collected_sqlite: str, tmp_path: Path) -> None:
    if not browser_available():
        pytest.fail("chromium and chromedriver are needed (apt-get install chromium chromium-driver)")
    window = current_window(30)
    _, result = calculate(load_results(collected_sqlite, window), window, Assumptions())
    expected = {h.label: h.value for h in headlines(result, Basis.ALLOCATION)}
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
    log = (tmp_path / "streamlit.log").open("w")
    app = subprocess.Popen([sys.executable, "-c", LAUNCHER, "--db", collected_sqlite, "--port", str(port)],
                           cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/_stcore/health", timeout_s=90)
        with headless_chromium() as browser:
            browser.open(f"http://127.0.0.1:{port}/")
            text = browser.wait_for_text(["Savings / month", expected["Savings / month"],
                                          "Every input and its provenance"], timeout_s=120)
            browser.wait_until(RENDERED, timeout_s=60)
            cells = browser.script("return [...document.querySelectorAll('[data-testid=\"stDataFrame\"] td')]"
                                   ".map(td => td.innerText).join('|')")
            png = browser.screenshot(tmp_path / "roi-app.png")
    finally:
        app.terminate()
        try:
            app.wait(15)
        except subprocess.TimeoutExpired:
            app.kill()
            app.wait(15)
        log.close()
    assert expected["Cost before / month"] in text and expected["Payback"] in text
    # Dense baselines are in the store: "after" is measured against them, in CPU words for probes run on a CPU.
    assert "Measured: CPU time per request after pruning" in text and "Measured: GPU time" not in text
    assert "Request volume" in cells and "assumed-default" in cells and "measured" in cells
    image = Image.open(tmp_path / "roi-app.png").convert("RGB")
    assert image.size[0] == 1400 and image.size[1] > 2000 and len(png) > 50_000
    pixels = np.asarray(image.resize((350, 600))).reshape(-1, 3)
    inked = float((pixels.min(axis=1) < 200).mean())
    assert inked > 0.03, f"screenshot is nearly blank ({inked:.1%} inked pixels)"
    assert len(np.unique(pixels, axis=0)) > 200, "screenshot has too few colours to hold charts"
