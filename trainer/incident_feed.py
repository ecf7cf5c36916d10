"""The demo terminal's incident lines: poll the embedded collector, print what opened.

While the launcher's embedded collector runs, `IncidentFeed` asks it every
`interval_s` for the run's incidents (GET /v1/runs/<run>/incidents with the
read token, a bounded timeout per request) and prints one line per incident
it has not printed yet:

    incident: nan step 40 rank 2 node node0  non-finite first in rank 2's forward at step 40 ...

and one line per action the collector's policy took, as it is taken and when it
ends (`action: rollback done  1.7 s after the incident  nan at step 30 on rank 1`).

At the end of the run `finish()` polls once more, asking the collector to answer
once its detection has judged every batch it acknowledged (`settle_s=`, bounded),
and prints the run's list (or "incidents: none"), its actions with their recovery
seconds, and its goodput. Only HTTP: the trainer does not import the collector
(DESIGN.md section 2). A collector that does not answer costs a timeout per poll
and one line on stderr, never the launcher.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Callable, TextIO

from agent.api import ApiClient


def read_token(tokens_dir: Path) -> str | None:
    """The read token the embedded collector wrote (or the user's one token), if any."""
    for name in ("read", "token"):
        try:
            token = (Path(tokens_dir) / name).read_text().strip()
        except OSError:
            continue
        if token:
            return token
    return None


def describe(inc: dict) -> str:
    """`incident: <kind> step <step_from> rank <rank> node <node>  <root cause>`."""
    def text(v) -> str:
        return "-" if v is None else str(v)

    evidence = inc.get("evidence")
    cause = inc.get("root_cause") or (evidence.get("summary") if isinstance(evidence, dict) else None) or ""
    return (f"incident: {text(inc.get('kind'))} step {text(inc.get('step_from'))} rank {text(inc.get('rank'))} "
            f"node {text(inc.get('node'))}  {cause}").rstrip()


def action_detail(a: dict) -> dict:
    """An actions row's `detail` as a dict (the API may hand it over as JSON text)."""
    detail = a.get("detail")
    if isinstance(detail, str):
        try:
            detail = json.loads(detail)
        except ValueError:
            detail = {}
    return detail if isinstance(detail, dict) else {}


def describe_action(a: dict) -> str:
    """`action: <kind> [node] <status>  [recovery]  <reason or outcome>`."""
    detail = action_detail(a)
    why = detail.get("refused") or detail.get("reason") or ""
    if a.get("status") == "failed" and (detail.get("failure") or detail.get("outcome")):
        why = f"{why} ({detail.get('failure') or detail.get('outcome')})"
    where = f" {a['node']}" if a.get("kind") == "isolate" and a.get("node") else ""
    rec = f"  {a['recovery_s']:.1f} s after the incident" if a.get("recovery_s") is not None else ""
    return f"action: {a.get('kind')}{where} {a.get('status')}{rec}  {why}".rstrip()


def describe_goodput(g: dict) -> str:
    if not g or g.get("goodput") is None:
        return "goodput: unknown"
    parts = [f"{g['productive_s']:.1f} s of {g['wall_s']:.1f} s wall in steps that counted"]
    if g.get("num_superseded"):
        parts.append(f"{g['num_superseded']} steps redone by later attempts")
    if g.get("num_skipped"):
        parts.append(f"{g['num_skipped']} skipped")
    return f"goodput: {100 * g['goodput']:.1f}% ({'; '.join(parts)})"


class IncidentFeed:
    def __init__(self, url: str, token: str, run_id: str, *, interval_s: float = 1.0, timeout_s: float = 2.0,
                 out: TextIO | None = None, fetch: Callable[[], list[dict]] | None = None,
                 fetch_actions: Callable[[], list[dict]] | None = None,
                 fetch_goodput: Callable[[], dict] | None = None) -> None:
        """`fetch`, `fetch_actions`, `fetch_goodput`: the run's incidents, actions and
        goodput (tests); by default the collector's query API (with `fetch` given and
        the others not, there are no actions and no goodput)."""
        self.url = url.rstrip("/")
        self.run_id = run_id
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.out = out or sys.stdout
        self._api = ApiClient(url, token, timeout_s=timeout_s)
        self._fetch = fetch or self._get
        default = fetch is None
        self._fetch_actions = fetch_actions or ((lambda: self._json("actions", [])) if default else (lambda: []))
        self._fetch_goodput = fetch_goodput or ((lambda: self._json("goodput", {})) if default else (lambda: {}))
        self._actions: dict = {}  # id -> (status, row) as last printed
        self._printed: set = set()
        self._incidents: dict = {}  # id -> latest row, in first-seen order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._warned = False
        self._settle_s = 0.0  # finish(): the last poll asks the collector to wait for detection

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="llmwatch-incident-feed", daemon=True)
        self._thread.start()

    def poll(self) -> None:
        """One request; prints a line per incident not printed before."""
        try:
            rows = self._fetch()
        except Exception as e:  # noqa: BLE001 - the demo's extra lines must never stop the launcher
            if not self._warned:
                self._warned = True
                print(f"trainer: cannot read incidents from the collector ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)
            return
        try:
            actions = self._fetch_actions()
        except Exception:  # noqa: BLE001 - as above; the incidents still print
            actions = []
        with self._lock:
            for inc in rows:
                key = inc.get("id", (inc.get("kind"), inc.get("rank"), inc.get("step_from")))
                self._incidents[key] = inc
                if key not in self._printed:
                    self._printed.add(key)
                    print(describe(inc), file=self.out, flush=True)
            for a in actions:
                seen = self._actions.get(a.get("id"))
                if seen is None or seen[0] != a.get("status"):
                    self._actions[a.get("id")] = (a.get("status"), a)
                    print(describe_action(a), file=self.out, flush=True)

    def finish(self, settle_s: float = 0.0) -> None:
        """Stop polling; poll once more, with the collector's detection caught up with the
        last batches (waiting at most `settle_s`), and print the run's incidents, or that
        there were none."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + self.interval_s)
        self._settle_s = settle_s
        self.poll()
        with self._lock:
            rows = list(self._incidents.values())
            actions = [a for _, a in self._actions.values()]
        if not rows:
            print("incidents: none", file=self.out, flush=True)
        else:
            print(f"incidents: {len(rows)}", file=self.out, flush=True)
            for inc in rows:
                print(f"  {describe(inc)[len('incident: '):]}  [{inc.get('status', '?')}]", file=self.out,
                      flush=True)
        if actions:
            print(f"actions: {len(actions)}", file=self.out, flush=True)
            for a in actions:
                print(f"  {describe_action(a)[len('action: '):]}", file=self.out, flush=True)
        try:
            good = self._fetch_goodput()
        except Exception:  # noqa: BLE001
            good = {}
        if good:
            print(describe_goodput(good), file=self.out, flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def _get(self) -> list[dict]:
        if self._settle_s > 0:
            return self._json("incidents", [], timeout_s=self.timeout_s + self._settle_s, settle_s=self._settle_s)
        return self._json("incidents", [])

    def _json(self, what: str, empty, *, timeout_s: float | None = None, **params):
        out = self._api.get_json(ApiClient.run_path(self.run_id, what), timeout_s=timeout_s, **params)
        return out if isinstance(out, type(empty)) else empty
