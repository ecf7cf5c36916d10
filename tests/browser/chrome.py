"""Headless Chromium for the dashboard's browser tests and tests/browser/screenshots.py.

Debian's `chromium` and its `chromium-driver` at fixed paths (.ci/run installs them).
Selenium is given both paths, so Selenium Manager never resolves or downloads
anything. What a page shows is read from the browser itself: every Plotly chart's
traces and empty-state text (`plots`), text rows (`rows_with`), and the console's
errors (`console_errors`).
"""

from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WIDTH_PX, HEIGHT_PX = 1440, 1800
ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--no-first-run", "--disable-sync",
        f"--window-size={WIDTH_PX},{HEIGHT_PX}")
PAGE_LOAD_TIMEOUT_S = 60
MAX_SHOT_HEIGHT_PX = 8000  # a full-page screenshot stops here


def missing() -> str | None:
    """Why the browser cannot run here, or None."""
    absent = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if absent:
        return (f"{' and '.join(absent)} not installed (Debian: apt-get install --no-install-recommends "
                "chromium chromium-driver; .ci/run does)")
    return None


def start_browser(profile_dir: Path):
    """A fresh headless Chromium with its own profile, logging every console message."""
    os.environ["SE_AVOID_STATS"] = "true"  # Selenium Manager sends no usage statistics (nor runs: paths given)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for a in ARGS:
        opts.add_argument(a)
    opts.add_argument(f"--user-data-dir={profile_dir}")
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(PAGE_LOAD_TIMEOUT_S)
    driver.set_script_timeout(30)
    return driver


# -- what a page shows ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plot:
    """One Plotly chart as the browser holds it."""

    id: str  # its dcc.Graph's id (a pattern-matching id is Dash's JSON of it)
    points: tuple[int, ...]  # points per trace
    notes: tuple[str, ...]  # paper-anchored annotations: an empty chart's message (dashboard/figures.empty)
    title: str

    @property
    def has_data(self) -> bool:
        return any(n > 0 for n in self.points)

    def describe(self) -> str:
        what = f"{len(self.points)} traces, points {list(self.points)}" if self.points else "no traces"
        return f"{self.id or '(no id)'} {self.title!r}: {what}; says {list(self.notes)}"


_PLOTS_JS = """
const len = v => (v && typeof v.length === 'number') ? v.length : 0;
return Array.from(document.querySelectorAll('.js-plotly-plot')).map(function (el) {
  const host = el.closest('.dash-graph') || el.parentElement || el;
  const layout = el.layout || {};
  const title = layout.title && typeof layout.title === 'object' ? layout.title.text : layout.title;
  return {
    id: host.id || '',
    // the full traces: there plotly has decoded the typed arrays a numpy column ships as
    // ({dtype, bdata} in el.data), and `_length` is what it draws
    points: (el._fullData || el.data || []).map(t => Math.max(t._length || 0, len(t.x), len(t.y), len(t.z),
                                                             len(t.values))),
    notes: (layout.annotations || []).filter(a => a.xref === 'paper' && a.yref === 'paper')
                                     .map(a => String(a.text || '')),
    title: String(title || ''),
  };
});
"""


def plots(driver) -> list[Plot]:
    return [Plot(p["id"], tuple(p["points"]), tuple(p["notes"]), p["title"])
            for p in driver.execute_script(_PLOTS_JS)]


def loading(driver) -> bool:
    """Dash is still computing some component's props."""
    return bool(driver.execute_script("return document.querySelectorAll('[data-dash-is-loading=\"true\"]').length"))


_ROWS_JS = """
const words = arguments[0];
const root = document.querySelector('main') || document.body;
const has = el => { const t = el.innerText || ''; return words.every(w => t.includes(w)); };
return Array.from(root.querySelectorAll('*')).filter(el =>
    el instanceof HTMLElement && !el.closest('.js-plotly-plot') && !el.querySelector('.js-plotly-plot') && has(el)
    && !Array.from(el.children).some(c => c instanceof HTMLElement && has(c))
).map(el => el.innerText);
"""


def rows_with(driver, *words: str) -> list[str]:
    """The text of each smallest element of the page's main area (charts left out) that
    holds every one of `words`: a table row, a list item or a card, whatever the page uses."""
    return driver.execute_script(_ROWS_JS, list(words))


def main_text(driver) -> str:
    return driver.execute_script("return (document.querySelector('main') || document.body).innerText")


def console_errors(driver) -> list[str]:
    """The console's SEVERE messages since the last call (reading the log drains it)."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def poll(check, timeout_s: float, interval_s: float = 0.25):
    """Call `check()` (a list of problems) until it returns none or `timeout_s` passed; the
    last problems ([] when it passed). Waits on the page, never a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while True:
        problems = check()
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(interval_s)


def screenshot(driver, path: Path) -> Path:
    """The whole page (up to MAX_SHOT_HEIGHT_PX tall) at the window's width, as PNG."""
    height = min(MAX_SHOT_HEIGHT_PX, int(driver.execute_script(
        "return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)")))
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": WIDTH_PX, "height": max(height, 1), "scale": 1}})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


def settle(driver, timeout_s: float = 30.0) -> list[Plot]:
    """Wait until the page is drawn: Dash computing nothing, no chart saying "loading…",
    and the charts the same on two looks in a row. The charts as last seen."""
    deadline = time.monotonic() + timeout_s
    last: list[Plot] | None = None
    while True:
        now = plots(driver)
        busy = loading(driver) or any("loading" in n.lower() for p in now for n in p.notes)
        if (not busy and now == last) or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.5)
