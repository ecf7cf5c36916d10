"""A finished run's tables cut back into the commits a live collector would have seen.

A closed DuckDB file does not record which rows came in which group commit
(rows carry no batch id), so `collector replay` re-cuts them: every row goes to
the window of `window_s` in which it was produced on its rank (`ts` for steps,
heartbeats, events and scalars; entry plus duration for collectives), and the
window is fed at its end plus `delay_s` (the agent's flush). Rank clocks are
close enough for that (they are what `start_ts` comparisons already rely on).
After the last row, empty passes run for `tail_s` so that verdicts made of
silence (a crash at the end, a hang) still come.

    for now, frames in replay_commits(whole_run, window_s=1.0):
        findings += analyzer.feed(frames, now=now)

Pure: frames in, (now, Frames) out.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import polars as pl

from analysis.frames import Frames

_TIME = {"steps": "ts", "heartbeats": "ts", "events": "ts", "scalars": "ts"}


def _times(name: str, df: pl.DataFrame) -> np.ndarray | None:
    if name == "collectives":
        t = df["start_ts"].to_numpy().astype(float)
        if "duration_s" in df.columns:
            t = t + np.nan_to_num(df["duration_s"].to_numpy().astype(float))
        return t
    col = _TIME.get(name)
    return df[col].to_numpy().astype(float) if col and col in df.columns else None


def replay_commits(run: Frames, *, window_s: float = 1.0, delay_s: float = 0.5,
                   tail_s: float = 30.0) -> Iterator[tuple[float, Frames]]:
    """(now, Frames) in time order; `ranks`, `runs`, `nodes` and `node_history` come with the first."""
    tables = run.tables()
    static = {k: tables.pop(k) for k in ("ranks", "runs", "nodes", "node_history") if k in tables}
    starts = [np.nanmin(t) for name, df in tables.items() if df.height and (t := _times(name, df)) is not None
              and np.isfinite(t).any()]
    if not starts:
        if static:
            yield 0.0, Frames(**static)
        return
    t0 = float(min(starts))
    parts: dict[int, dict[str, pl.DataFrame]] = {}
    for name, df in tables.items():
        t = _times(name, df)
        if t is None or not df.height:
            continue
        win = np.floor((np.nan_to_num(t, nan=t0) - t0) / window_s).astype(np.int64)
        df = df.with_columns(pl.Series("_w", win))
        for (w,), part in df.partition_by("_w", as_dict=True, include_key=False).items():
            parts.setdefault(int(w), {})[name] = part
    last = max(parts)
    for w in range(0, last + 1 + int(np.ceil(tail_s / window_s))):
        got = parts.get(w, {})
        if w == 0:
            got = {**got, **static}
        yield t0 + (w + 1) * window_s + delay_s, Frames(**got)
