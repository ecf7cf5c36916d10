"""The job's membership between rounds, shared by the ranks and the launcher: the
exit code that asks for a restart and the run's membership file (the nodes
isolated so far). No torch here: the launcher (trainer/supervisor.py) imports it,
and a launcher that imported torch would add its import and teardown (~1.5 s of
CPU on a small host) to every start, restart and end of a job.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EXIT_RESTART = 75  # EX_TEMPFAIL: every rank exits with it after `isolate`; the supervisor restarts the job
MEMBERSHIP_FILE = "membership.json"  # in the run dir: the nodes isolated so far, read by the supervisor


def under_elastic_agent() -> bool:
    """This rank is a worker of torchrun's elastic agent (not of the embedded launcher,
    which sets torchrun's rank variables too, but not this one)."""
    return "TORCHELASTIC_RESTART_COUNT" in os.environ


def record_isolation(run_dir: Path, *, node: str, reason: str, incident_id: Any, step: int, command_id: str) -> None:
    """Append `node` to the run's membership file (atomically replaced)."""
    path = Path(run_dir) / MEMBERSHIP_FILE
    current = read_membership(run_dir)
    if node not in {x["node"] for x in current["isolated"]}:
        current["isolated"].append({"node": node, "reason": reason, "incident_id": incident_id, "step": step,
                                    "command_id": command_id, "ts": time.time()})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(current, indent=2))
    tmp.replace(path)


def read_membership(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((Path(run_dir) / MEMBERSHIP_FILE).read_text())
        if isinstance(data, dict) and isinstance(data.get("isolated"), list):
            return data
    except (OSError, ValueError):
        pass
    return {"isolated": []}
