"""The dashboard in a real headless Chromium, on real processes: a collector with a token
file per role, a faulted 4-rank run shipping to it (tests/browser/stack.py), and the
dashboard's own process, live on the collector and then postmortem on its file.

What is asserted is what a person would see: a chart's points as the browser holds
them, text on the page, the URL, the console. The truth it is held to is the
collector's answer for the same run. One run serves the module; the live test comes
first (the run is training while it looks) and the postmortem one last (it stops the
collector). Every wait is a bounded poll.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlparse

import pytest

from dashboard.app import PAGES as APP_PAGES
from tests.browser import chrome, screenshots
from tests.browser.stack import NUM_STEPS, RUN_ID, SPIKE_STEP, STRAGGLER, Dashboard, LiveStack
from tests.polling import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.integration]

# page -> (path, charts it draws at least, messages of the charts allowed to be empty for this run)
PAGES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "overview": ("/", 7, ()),  # five curves, eval loss by domain, the rollback lineage
    "ranks": ("/ranks", 3, ()),  # step time heatmap, where the step goes, the mesh
    "comm": ("/comm", 4, ()),  # time and size by axis and op, latency per group, who waited for whom
    "incidents": ("/incidents", 1, ()),  # the timeline (the rest are tables)
    "nodes": ("/nodes", 2, ()),  # ranks per node, checkpoint write time
    "sql": ("/sql", 1, ()),  # the result's chart (the default example's, on arrival)
    "runs": ("/runs", 2, ()),  # loss by run, where the wall time went
    "fleet": ("/fleet", 2, ()),  # goodput by run, faults by run and node (one run here)
}
DRAW_TIMEOUT_S = 30.0  # a page's charts, drawn from a finished run
LOSS_POINTS_JS = """
const el = document.querySelector(`[id*='"name":"loss"'][id*='ov-curve'] .js-plotly-plot`);
if (!el || !el.data) { return -1; }
return Math.max(0, ...el.data.map(t => (t.x || []).length));
"""


# -- fixtures ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(browser, tmp_path_factory):
    """Collector, live dashboard, and the run (started, not awaited). After `browser`: a
    machine without Chromium skips before anything is started."""
    s = LiveStack(tmp_path_factory.mktemp("stack"))
    try:
        yield s.start()
    finally:
        s.close()


@pytest.fixture(scope="module")
def finished(stack):
    """The run ended; the faults the pages are checked for were detected and handled (if not,
    the run, not a page, is what failed)."""
    run = stack.wait_finished()
    incidents, actions = stack.api("/incidents"), stack.api("/actions")
    kinds = {(i["kind"], i["rank"], i["node"]) for i in incidents}
    report = f"incidents {[(i['kind'], i['rank'], i['node'], i['step_from']) for i in incidents]}, " \
             f"actions {[(a['kind'], a['status']) for a in actions]}\n{stack.trainer_output()}"
    assert ("loss_spike", None, None) in kinds, report
    assert ("straggler", STRAGGLER["rank"], STRAGGLER["node"]) in kinds, report
    assert ("rollback", "done") in {(a["kind"], a["status"]) for a in actions}, report
    assert run["last_step"] == NUM_STEPS, report
    return run


def url(base: str, page: str) -> str:
    """The page of the run under test on the dashboard at `base`."""
    return f"{base}{PAGES[page][0]}?run={RUN_ID}"


def chart_problems(driver, page: str) -> list[str]:
    """What keeps `page` from showing data: too few charts, or a chart with no points that
    does not say one of the page's allowed reasons."""
    _, at_least, allowed = PAGES[page]
    drawn = chrome.plots(driver)
    problems = [f"{len(drawn)} charts, expected at least {at_least}"] if len(drawn) < at_least else []
    for p in drawn:
        if not p.has_data and not any(a in n for n in p.notes for a in allowed):
            problems.append(f"no data in {p.describe()}")
    return problems


def quiet_errors(driver) -> list[str]:
    """The console's errors once Dash has finished this page's callbacks (bounded wait)."""
    chrome.poll(lambda: ["busy"] if chrome.loading(driver) else [], 10.0)
    return chrome.console_errors(driver)


def open_page(driver, address: str) -> None:
    # off the last page first, whose timers could still fire against a server stopped since
    # (a CI run read the live dashboard's refused callbacks as the postmortem page's errors)
    driver.get("about:blank")
    chrome.console_errors(driver)  # drained: what is read next is this page's
    driver.get(address)


# -- while the run trains ---------------------------------------------------------------------------------

def test_pages_under_test_are_the_apps_pages():
    assert sorted(PAGES) == sorted(APP_PAGES)


def test_overview_draws_new_steps_live_without_a_reload(browser, stack):
    wait_for(lambda: (stack.api() or {}).get("last_step"), 90, "the run's first steps at the collector")
    address = url(stack.dashboard.url, "overview")
    open_page(browser, address)
    browser.execute_script("window.__llmwSameDocument = true")
    first = wait_for(lambda: browser.execute_script(LOSS_POINTS_JS) > 0 and browser.execute_script(LOSS_POINTS_JS),
                     30, "the loss chart's first points")
    assert stack.running() and (stack.api() or {}).get("last_step", NUM_STEPS) < NUM_STEPS, \
        "the run ended before the page first drew: nothing left to see arrive live"
    more = wait_for(lambda: (n := browser.execute_script(LOSS_POINTS_JS)) > first and n, 60,
                    f"the loss chart to grow past {first} points without a reload")
    assert more > first
    # the same document all along (a reload would have dropped the flag), at the same address
    assert browser.execute_script(
        "return window.__llmwSameDocument === true && performance.getEntriesByType('navigation').length") == 1
    now = urlparse(browser.current_url)
    assert now.path == "/" and parse_qs(now.query).get("run") == [RUN_ID], browser.current_url
    assert quiet_errors(browser) == []


# -- after the run ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", list(PAGES))
def test_page_draws_its_charts_with_data_and_no_console_errors(browser, stack, finished, page, tmp_path):
    open_page(browser, url(stack.dashboard.url, page))
    problems = chrome.poll(lambda: chart_problems(browser, page), DRAW_TIMEOUT_S)
    chrome.screenshot(browser, tmp_path / f"{page}.png")  # an artefact for a failure's report
    assert problems == [], f"{page}: {problems}"
    assert quiet_errors(browser) == [], page


def _shown(driver, *words: str) -> list[str]:
    """Rows holding every word; a snake_case word may also read with spaces."""
    rows = chrome.rows_with(driver, *words)
    if not rows and any("_" in w for w in words):
        rows = chrome.rows_with(driver, *(w.replace("_", " ") for w in words))
    return rows


def test_incidents_page_names_the_faults_their_culprits_and_what_was_done(browser, stack, finished):
    open_page(browser, url(stack.dashboard.url, "incidents"))

    def missing() -> list[str]:
        out = []
        for inc in stack.api("/incidents"):
            if not _shown(browser, inc["kind"]):
                out.append(f"incident {inc['kind']} (#{inc['id']}) not shown")
        rows = _shown(browser, "straggler", STRAGGLER["node"])
        if not any(re.search(rf"\b{STRAGGLER['rank']}\b", r) for r in rows):
            out.append(f"no straggler row naming rank {STRAGGLER['rank']} on {STRAGGLER['node']}: {rows}")
        spike = _shown(browser, "loss_spike")
        if not any(re.search(rf"\b{SPIKE_STEP}\b", r) for r in spike):
            out.append(f"no loss_spike row at step {SPIKE_STEP}: {spike}")
        for a in stack.api("/actions"):
            if not _shown(browser, a["kind"], a["status"]):
                out.append(f"action {a['kind']} {a['status']} (#{a['id']}) not shown")
        return out

    problems = chrome.poll(missing, DRAW_TIMEOUT_S)
    assert problems == [], f"{problems}\npage text:\n{chrome.main_text(browser)[:3000]}"
    assert quiet_errors(browser) == []


def _table_rows(driver, table_id: str) -> list[list[str]]:
    return driver.execute_script("""
        const t = document.getElementById(arguments[0]);
        if (!t) { return []; }
        return Array.from(t.querySelectorAll('tr')).map(tr =>
            Array.from(tr.querySelectorAll('td')).map(td => td.innerText.trim())).filter(r => r.length);
    """, table_id)


def _run_query(driver, text: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.ID, "sql-text")
    box.click()
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE)
    box.send_keys(text)
    wait_for(lambda: box.get_attribute("value") == text, 10, "the query typed into the editor")
    driver.find_element(By.ID, "sql-run").click()


def _message(driver) -> str:
    return driver.execute_script("const m = document.getElementById('sql-message'); return m ? m.innerText : ''")


def test_sql_console_shows_a_selects_rows_and_the_collectors_refusal_of_a_write(browser, stack, finished):
    query = (f"SELECT rank, count(*) AS num_steps FROM steps WHERE run_id = '{RUN_ID}' "
             "GROUP BY rank ORDER BY rank")
    truth = [[str(v) for v in row] for row in stack.sql(query)]
    assert [r[0] for r in truth] == ["0", "1", "2", "3"]
    open_page(browser, url(stack.dashboard.url, "sql"))
    wait_for(lambda: _message(browser), DRAW_TIMEOUT_S, "the default example's answer")  # the page is drawn
    _run_query(browser, query)
    differs = chrome.poll(lambda: [] if _table_rows(browser, "sql-table") == truth else ["differs"], DRAW_TIMEOUT_S)
    assert differs == [], f"table {_table_rows(browser, 'sql-table')}, expected {truth}; message {_message(browser)!r}"
    chart = next(p for p in chrome.plots(browser) if p.id == "sql-chart")
    assert chart.has_data and max(chart.points) == len(truth), chart.describe()  # a point (bar) per rank
    assert parse_qs(urlparse(browser.current_url).query).get("q") == [query]  # a pasted link runs it again

    _run_query(browser, "DELETE FROM runs")
    refusal = "only SELECT is allowed"
    wait_for(lambda: refusal in _message(browser), DRAW_TIMEOUT_S, f"the refusal {refusal!r}")
    assert "DELETE" in _message(browser), _message(browser)
    assert stack.api()["run_id"] == RUN_ID  # and nothing was deleted
    assert quiet_errors(browser) == []


def test_the_url_keeps_the_pages_state_and_a_fresh_page_restores_it(browser, stack, finished):
    from selenium.webdriver.common.by import By

    loss_x_is_time = """
        const el = document.querySelector(`[id*='"name":"loss"'][id*='ov-curve'] .js-plotly-plot`);
        const t = el && el.data && el.data.find(t => (t.x || []).length);
        return t ? typeof t.x[0] === 'string' && !isNaN(Date.parse(t.x[0])) : null;
    """
    open_page(browser, url(stack.dashboard.url, "overview"))
    wait_for(lambda: browser.execute_script(loss_x_is_time) is False, DRAW_TIMEOUT_S, "the loss chart by step")
    browser.find_element(By.CSS_SELECTOR, "#ov-x input[value='time']").click()
    wait_for(lambda: parse_qs(urlparse(browser.current_url).query).get("x") == ["time"], 10, "x=time in the URL")
    wait_for(lambda: browser.execute_script(loss_x_is_time), DRAW_TIMEOUT_S, "the loss chart by wall time")
    link = browser.current_url
    assert parse_qs(urlparse(link).query).get("run") == [RUN_ID]

    first = browser.current_window_handle
    browser.switch_to.new_window("tab")
    try:
        open_page(browser, link)
        wait_for(lambda: browser.execute_script(loss_x_is_time), DRAW_TIMEOUT_S,
                 "the pasted link's loss chart by wall time")
        assert browser.find_element(By.CSS_SELECTOR, "#ov-x input[value='time']").is_selected()
        assert parse_qs(urlparse(browser.current_url).query).get("x") == ["time"]
        assert quiet_errors(browser) == []
    finally:
        browser.close()
        browser.switch_to.window(first)


# -- postmortem (last: it stops the collector) ------------------------------------------------------------

def test_postmortem_dashboard_on_the_closed_file(browser, stack, finished, tmp_path):
    assert stack.stop_collector() == 0
    pm = Dashboard(tmp_path, "postmortem", "--db", str(stack.db)).start()
    try:
        for page in ("overview", "incidents"):
            open_page(browser, url(pm.url, page))
            problems = chrome.poll(lambda: chart_problems(browser, page), DRAW_TIMEOUT_S)
            assert problems == [], f"postmortem {page}: {problems}"
            assert quiet_errors(browser) == [], page
        missing = chrome.poll(lambda: [k for k in ("loss_spike", "straggler") if not _shown(browser, k)],
                              DRAW_TIMEOUT_S)
        assert missing == [], f"the postmortem incidents page does not show {missing}"
        assert "postmortem" in browser.find_element("id", "source-desc").text
        # tests/browser/screenshots.py, as the docs' screenshots are made: every page, 1440 px wide
        assert screenshots.shoot(browser, pm.url, list(PAGES), tmp_path / "shots", RUN_ID) == 0
        for page in PAGES:
            png = (tmp_path / "shots" / f"{page}.png").read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == chrome.WIDTH_PX, page
    finally:
        pm.stop()
