"""Ship what a run left in its spool, after the fact.

    python -m agent.replay runs/<run id>/spool --url http://127.0.0.1:4318 [--token T]

A rank whose collector was away when training ended leaves its unsent batches
in `<spool dir>/rank*/`. The next incarnation of that rank replays them by
itself; this command is for a run that will not be restarted. Batches go in
order, oldest first; the collector stores a batch seen twice once, so running
it again, or after a partial replay, is safe. A batch the collector refuses
(4xx) is reported and skipped; a collector that is down stops the replay with
the rest left in place.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from agent.spool import Spool, SpoolBusy
from agent.transport import HttpClient


def replay_dir(directory: Path, client: HttpClient) -> tuple[int, int, bool]:
    """Replay one spool directory. Returns (sent, refused, complete)."""
    sent = refused = 0
    spool = Spool(str(directory), max_bytes=1 << 62)
    try:
        while (payload := spool.peek()) is not None:
            res = client.post(payload)
            if res.status == "unavailable":
                print(f"{directory}: collector unavailable ({res.reason}); {sent} sent, the rest kept",
                      file=sys.stderr)
                return sent, refused, False
            if res.status == "rejected":
                refused += 1
                print(f"{directory}: a batch was refused ({res.reason}); skipped", file=sys.stderr)
            else:
                sent += 1
            spool.pop()
    finally:
        spool.close()
    return sent, refused, True


def spool_dirs(root: Path) -> list[Path]:
    """`root` itself if it is a spool, else its subdirectories that are."""
    if any(p.name.startswith("seg-") for p in root.iterdir()):
        return [root]
    return sorted(p for p in root.iterdir() if p.is_dir() and any(q.name.startswith("seg-") for q in p.iterdir()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spool", type=Path, help="a run's spool directory (or one rank's)")
    p.add_argument("--url", required=True, help="collector URL")
    p.add_argument("--token", default=os.environ.get("LLMWATCH_TOKEN"), help="bearer token (env LLMWATCH_TOKEN)")
    p.add_argument("--timeout-s", type=float, default=10.0)
    a = p.parse_args(argv)
    if not a.spool.is_dir():
        print(f"replay: {a.spool} is not a directory", file=sys.stderr)
        return 2
    client = HttpClient(a.url.rstrip("/"), a.token, a.timeout_s)
    ok = True
    total = 0
    try:
        for d in spool_dirs(a.spool):
            try:
                sent, refused, complete = replay_dir(d, client)
            except SpoolBusy:
                print(f"{d}: in use by a live agent; it replays by itself", file=sys.stderr)
                continue
            total += sent
            ok = ok and complete
            print(f"{d}: {sent} batches sent, {refused} refused")
    finally:
        client.close()
    print(f"replayed {total} batches")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
