"""Debian's headless Chromium, driven by selenium, for every test that looks at a page (tests/commands/test_page.py,
test_notebook.py): where it is, a mark that skips with the reason where it is not, one way to start it, and what
its console said."""

from __future__ import annotations

import shutil

import pytest

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver; "
    ".ci/run does it)",
)
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1400",
    "--allow-file-access-from-files",  # a notebook page's frames read the plotly.js its own page holds
)


def chromium():
    """A new headless Chromium that keeps its console (and the network log: what a page asked for)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(service=Service(DRIVER), options=options)


def console_problems(browser) -> list[str]:
    return [entry["message"] for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]
