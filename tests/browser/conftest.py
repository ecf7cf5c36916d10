"""One headless Chromium per test module (starting one costs seconds on 2 cores).

Without Debian's chromium and chromedriver (tests/browser/chrome.py's paths) the
browser tests are skipped, except in CI (`$CI` set), where they fail: .ci/run
installs both, as tests/integration/test_alertmanager.py does for its binary.
"""

from __future__ import annotations

import os

import pytest

from tests.browser import chrome


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    why = chrome.missing()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the browser tests need Chromium: {why}")
        pytest.skip(f"the browser tests need Chromium: {why}")
    driver = chrome.start_browser(tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield driver
    finally:
        driver.quit()
