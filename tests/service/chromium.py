"""Debian's chromium, headless, driven by selenium through Debian's chromium-driver
(no browser download): the on-call page's browser tests share it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from tests.engines import require_tool

T = TypeVar("T")


@contextlib.contextmanager
def chromium(*extra_args: str) -> Iterator[Any]:
    """A headless chromium (skipped where Debian's chromium/chromedriver are missing)."""
    binary = require_tool("chromium")
    driver_path = require_tool("chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,1100")
    for arg in extra_args:
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_until(what: str, probe: Callable[[], T | None], limit: float) -> T:
    """Poll until `probe` gives something (a deadline, not a timing assertion)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        found = probe()
        if found:
            return found
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {limit:g} s")
