"""The demo terminal's incident lines: poll the embedded collector, print what opened.

While the launcher's embedded collector runs, `IncidentFeed` asks it every
`interval_s` for the run's incidents (GET /v1/runs/<run>/incidents with the
read token, a bounded timeout per request) and prints one line per incident
it has not printed yet:

    incident: nan step 40 rank 2 node node0  non-finite first in rank 2's forward at step 40 ...

At the end of the run `finish()` polls once more and prints the run's list
(or "incidents: none"). Only HTTP: the trainer does not import the collector
(DESIGN.md section 2). A collector that does not answer costs a timeout per poll
and one line on stderr, never the launcher.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, TextIO


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


class IncidentFeed:
    def __init__(self, url: str, token: str, run_id: str, *, interval_s: float = 1.0, timeout_s: float = 2.0,
                 out: TextIO | None = None, fetch: Callable[[], list[dict]] | None = None) -> None:
        """`fetch`: returns the run's incidents (tests); default the collector's query API."""
        self.url = url.rstrip("/")
        self.run_id = run_id
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.out = out or sys.stdout
        self._token = token
        self._fetch = fetch or self._get
        self._printed: set = set()
        self._incidents: dict = {}  # id -> latest row, in first-seen order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._warned = False

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
        with self._lock:
            for inc in rows:
                key = inc.get("id", (inc.get("kind"), inc.get("rank"), inc.get("step_from")))
                self._incidents[key] = inc
                if key not in self._printed:
                    self._printed.add(key)
                    print(describe(inc), file=self.out, flush=True)

    def finish(self, settle_s: float = 0.0) -> None:
        """Stop polling; after `settle_s` (the collector's detection catching up with the
        last batches) poll once more and print the run's incidents, or that there were none."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + self.interval_s)
        if settle_s > 0:
            threading.Event().wait(settle_s)
        self.poll()
        with self._lock:
            rows = list(self._incidents.values())
        if not rows:
            print("incidents: none", file=self.out, flush=True)
            return
        print(f"incidents: {len(rows)}", file=self.out, flush=True)
        for inc in rows:
            print(f"  {describe(inc)[len('incident: '):]}  [{inc.get('status', '?')}]", file=self.out, flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def _get(self) -> list[dict]:
        req = urllib.request.Request(f"{self.url}/v1/runs/{urllib.parse.quote(self.run_id, safe='')}/incidents",
                                     headers={"Authorization": f"Bearer {self._token}"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            rows = json.loads(resp.read())
        return rows if isinstance(rows, list) else []
