"""Detection and root cause: pure functions over polars frames of the collector's tables.

Public face:

    from analysis import Analyzer, Frames, load_rules

    analyzer = Analyzer(load_rules(rules_path))            # rules_path None: the defaults
    findings = analyzer.feed(Frames.from_arrow(tables), now=commit_ts)   # per commit
    findings = analyzer.tick(now=ts)                       # no commit for a while

`Finding` (analysis/findings.py) is what comes out: one incident per `key`,
opened, updated, then resolved. `replay_commits` (analysis/replay.py) cuts a
finished run back into commits for `collector replay`; `score`
(analysis/scoring.py) matches findings to injected ground truth. Nothing here reads a clock, does I/O (but
`load_rules`, once) or starts a thread.
"""

from analysis.engine import Analyzer, run_pass
from analysis.findings import KINDS, OPEN, RESOLVED, Finding, IncidentBook, json_number
from analysis.frames import FrameError, Frames
from analysis.registry import build_detectors, detector_names, register
from analysis.replay import replay_commits
from analysis.rules import Rules, RulesError, load_rules, rules_from_dict
from analysis.scoring import Score, Truth, incidents, score, truths_from_rows
from analysis.state import RunState, new_run_state

__all__ = ["Analyzer", "run_pass", "KINDS", "OPEN", "RESOLVED", "Finding", "IncidentBook", "json_number", "Frames",
           "FrameError", "build_detectors", "detector_names", "register", "Rules", "RulesError", "load_rules",
           "rules_from_dict", "RunState", "new_run_state", "Score", "Truth", "incidents", "score", "truths_from_rows",
           "replay_commits"]
