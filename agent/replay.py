"""Ship what a run left in its spool, after the fact.

    LLMWATCH_TOKEN=... python -m agent.replay runs/<run id>/spool --url http://127.0.0.1:4318
    python -m agent.replay runs/<run id>/spool --url https://collector:4318 --token-file ~/.llmwatch-token \
        --ca-file collector-ca.pem

A rank whose collector was away when training ended leaves its unsent batches
in `<spool dir>/rank*/`. The next incarnation of that rank replays them by
itself; this command is for a run that will not be restarted. Batches go in
order, oldest first; the collector stores a batch seen twice once, so running
it again, or after a partial replay, is safe. A batch the collector refuses
(4xx) is reported and skipped; a collector that is down, or that refuses the
token (401, 403: every batch would be refused the same way), stops the replay
with the rest left in place.

Batches the agent set aside after repeated error answers sit in
`<rank dir>/quarantine/`. They are not replayed with the rest (they failed
already); point this command at such a directory to replay it on purpose.

The token: from `--token-file PATH` (first line) or `$LLMWATCH_TOKEN`, so it need
not appear on a command line, where `ps` shows it to every user of the machine.
`--token` still works.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from agent.spool import QUARANTINE, Spool, SpoolBusy
from agent.transport import HttpClient

TOKEN_ENV = "LLMWATCH_TOKEN"


def replay_dir(directory: Path, client: HttpClient) -> tuple[int, int, bool]:
    """Replay one spool directory. Returns (sent, refused, complete)."""
    sent = refused = 0
    spool = Spool(str(directory), max_bytes=1 << 62)
    try:
        while (payload := spool.peek()) is not None:
            res = client.post(payload)
            if res.code in (401, 403):
                print(f"{directory}: the collector refused the token ({res.reason}); {sent} sent, the rest kept",
                      file=sys.stderr)
                return sent, refused, False
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


def _has_segments(d: Path) -> bool:
    return any(p.name.startswith("seg-") for p in d.iterdir())


def spool_dirs(root: Path) -> list[Path]:
    """`root` itself if it is a spool (a quarantine directory included), else its
    subdirectories that are, quarantines left out."""
    if _has_segments(root):
        return [root]
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name != QUARANTINE and _has_segments(p))


def quarantine_dirs(root: Path) -> list[Path]:
    """The non-empty quarantines under `root` (one rank's directory or a run's spool)."""
    if root.name == QUARANTINE:
        return []
    found = [q for q in (root / QUARANTINE, *(p / QUARANTINE for p in root.iterdir() if p.is_dir()))
             if q.is_dir() and _has_segments(q)]
    return sorted(found)


def read_token(a: argparse.Namespace) -> str | None:
    """--token-file, else --token, else $LLMWATCH_TOKEN."""
    if a.token_file:
        lines = Path(a.token_file).read_text().splitlines()
        return (lines[0].strip() if lines else "") or None
    return a.token or os.environ.get(TOKEN_ENV) or None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agent.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spool", type=Path, help="a run's spool directory, one rank's, or a quarantine")
    p.add_argument("--url", required=True, help="collector URL (http:// or https://)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--token-file", help="file whose first line is the bearer token")
    src.add_argument("--token", help=f"bearer token (visible in ps: prefer ${TOKEN_ENV} or --token-file)")
    p.add_argument("--ca-file", help="https: PEM bundle to verify the collector's certificate (default: the "
                                     "system's trust store)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="per POST (default 10 s)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not a.spool.is_dir():
        print(f"replay: {a.spool} is not a directory", file=sys.stderr)
        return 2
    try:
        token = read_token(a)
    except (OSError, ValueError) as e:  # missing, unreadable, not text
        print(f"replay: cannot read the token file: {e}", file=sys.stderr)
        return 2
    try:
        client = HttpClient(a.url.rstrip("/"), token, a.timeout_s, ca_file=a.ca_file)
    except ValueError as e:
        print(f"replay: {e}", file=sys.stderr)
        return 2
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
    for q in quarantine_dirs(a.spool):
        print(f"{q}: batches set aside after error answers; not replayed (replay that directory to send them)",
              file=sys.stderr)
    print(f"replayed {total} batches")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
