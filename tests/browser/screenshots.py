"""Screenshots of every dashboard page, 1440 px wide, for docs/screenshots/.

    python -m tests.browser.screenshots --out docs/screenshots                 # runs/demo's file (make demo)
    python -m tests.browser.screenshots --db runs/demo/telemetry.duckdb --run demo --out docs/screenshots
    python -m tests.browser.screenshots --url http://127.0.0.1:8050 --out /tmp/shots   # a running dashboard

With --db it starts a postmortem dashboard of its own on a free loopback port (the
file must be closed: a collector that still holds it answers at --url instead). Each
page is shot once drawn (tests/browser/chrome.py's `settle`) as <out>/<page>.png; a
page whose charts never finished drawing, or that logged console errors, is reported
and makes the exit status 1. Needs Debian's chromium and chromium-driver.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

from tests.browser import chrome

DEFAULT_DB = "runs/demo/telemetry.duckdb"  # the Makefile's demo run


def page_path(page: str) -> str:
    return "/" if page == "overview" else f"/{page}"


def shoot(driver, base_url: str, pages: list[str], out: Path, run_id: str | None) -> int:
    failed = 0
    query = f"?run={quote(run_id)}" if run_id else ""
    for page in pages:
        chrome.console_errors(driver)
        driver.get(base_url.rstrip("/") + page_path(page) + query)
        drawn = chrome.settle(driver)
        path = chrome.screenshot(driver, out / f"{page}.png")
        empty = [p for p in drawn if not p.has_data]
        errors = chrome.console_errors(driver)
        stuck = [p for p in drawn if any("loading" in n.lower() for n in p.notes)]
        print(f"{page}: {path} ({len(drawn)} charts, {len(empty)} without data)")
        for p in empty:
            print(f"  no data: {p.describe()}")
        for e in errors:
            print(f"  console error: {e}")
        failed += bool(errors or stuck)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    from dashboard.app import PAGES

    p = argparse.ArgumentParser(prog="python -m tests.browser.screenshots", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--db", help=f"a closed run file to serve (default {DEFAULT_DB})")
    src.add_argument("--url", help="a running dashboard's URL")
    p.add_argument("--run", help="the run to show (default: the dashboard's newest)")
    p.add_argument("--pages", default=",".join(PAGES), help=f"comma-separated (default {','.join(PAGES)})")
    p.add_argument("--out", required=True, type=Path, help="directory for <page>.png")
    args = p.parse_args(argv)
    why = chrome.missing()
    if why:
        print(f"screenshots: {why}", file=sys.stderr)
        return 2
    pages = [x for x in args.pages.split(",") if x]
    unknown = sorted(set(pages) - set(PAGES))
    if unknown:
        print(f"screenshots: unknown pages {unknown} (the app's: {', '.join(PAGES)})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="llmwatch-shots-") as tmp:
        dashboard = None
        if args.url:
            base = args.url
        else:
            from tests.browser.stack import Dashboard

            db = Path(args.db or DEFAULT_DB)
            if not db.is_file():
                print(f"screenshots: no run file at {db} (make demo writes {DEFAULT_DB})", file=sys.stderr)
                return 2
            dashboard = Dashboard(Path(tmp), "screenshots", "--db", str(db.resolve())).start()
            base = dashboard.url
        driver = chrome.start_browser(Path(tmp) / "profile")
        try:
            return shoot(driver, base, pages, args.out, args.run)
        finally:
            driver.quit()
            if dashboard is not None:
                dashboard.stop()


if __name__ == "__main__":
    sys.exit(main())
