"""The input contract: builders, zero-copy from Arrow (dictionary columns), one frame per run."""

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from analysis.frames import (
    OPTIONAL,
    REQUIRED,
    FrameError,
    Frames,
    Interner,
    heartbeats_frame,
    iter_steps,
    key_order,
    step_keys,
    steps_frame,
)


def test_builders_fill_missing_required_columns_with_nulls():
    df = steps_frame([{"run_id": "r", "attempt": 0, "step": 1, "rank": 0, "loss": 2.0}])
    assert set(REQUIRED["steps"]) <= set(df.columns)
    assert df["grad_norm"].null_count() == 1
    assert "local_loss" not in df.columns  # optional columns only when given


def test_from_arrow_accepts_dictionary_columns_and_splits_runs():
    run = pa.DictionaryArray.from_arrays(pa.array([0, 0, 1], pa.int16()), pa.array(["a", "b"]))
    hb = pa.table({"run_id": run, "rank": pa.array([0, 1, 0], pa.int32()), "ts": [1.0, 1.0, 2.0],
                   "node": pa.DictionaryArray.from_arrays(pa.array([0, 0, 0], pa.int16()), pa.array(["n0"])),
                   "pid": pa.array([1, 2, 3], pa.int64()),
                   "phase": pa.DictionaryArray.from_arrays(pa.array([0, 0, 0], pa.int16()), pa.array(["train"])),
                   "step": pa.array([1, 1, 1], pa.int64()), "last_seq": pa.array([5, 5, 7], pa.int64())})
    f = Frames.from_arrow({"heartbeats": hb, "unknown_table": hb})
    f.check()
    assert f.heartbeats["run_id"].dtype == pl.Categorical
    per = f.split_runs()
    assert sorted(per) == ["a", "b"] and per["a"].heartbeats.height == 2 and per["b"].steps is None


def test_check_names_the_missing_column():
    with pytest.raises(FrameError, match="last_seq"):
        Frames(heartbeats=pl.DataFrame({"run_id": ["r"], "rank": [0]})).check()


def test_interned_codes_are_equal_for_equal_strings_across_frames():
    table = Interner()
    a = table.codes(pl.Series(["tp", "dp", "tp"]))
    b = table.codes(pl.Series(["dp", "tp"], dtype=pl.Categorical))
    assert a[0] == a[2] == b[1] and a[1] == b[0] and a[0] != a[1]


def test_categorical_codes_match_the_string_path_nulls_included():
    """Categorical columns go through their Arrow dictionary: the same name for every row as
    the string path, -1 for a null, across frames (each with a dictionary of its own order),
    for a slice of a frame, and for an empty or all-null column."""
    chunks = (["tp", "dp", None, "pp", "dp", "ctrl", None], ["pp", "new", None], [], [None, None])
    table, strings = Interner(), Interner()
    for chunk in chunks:
        got = table.codes(pl.Series(chunk, dtype=pl.Categorical))
        want = strings.codes(pl.Series(chunk, dtype=pl.String))
        assert got.dtype == want.dtype == np.int64
        assert [table.names[c] if c >= 0 else None for c in got] == chunk
        assert [strings.names[c] if c >= 0 else None for c in want] == chunk
    assert sorted(table.names) == sorted(strings.names) == ["ctrl", "dp", "new", "pp", "tp"]
    frame = pl.from_arrow(pa.table({"axis": pa.array(["world", "dp", None, "tp", "dp"]).dictionary_encode()}))
    part = frame["axis"].slice(1, 3)
    assert [table.names[c] if c >= 0 else None for c in table.codes(part)] == ["dp", None, "tp"]
    assert [table.names[c] for c in table.codes(pl.concat([part, frame["axis"]]).drop_nulls())] == \
        ["dp", "tp", "world", "dp", "tp", "dp"]


def test_iter_steps_slices_a_sorted_frame():
    df = steps_frame({"run_id": ["r"] * 5, "attempt": [0, 0, 0, 1, 1], "step": [1, 1, 2, 1, 1],
                      "rank": [0, 1, 0, 0, 1]})
    got = [(a, s, rows.height) for a, s, rows in iter_steps(df)]
    assert got == [(0, 1, 2), (0, 2, 1), (1, 1, 2)]
    assert len(np.unique(step_keys(df))) == 3


def test_optional_columns_are_documented_with_a_meaning():
    for table, cols in OPTIONAL.items():
        for name, (_, meaning) in cols.items():
            assert meaning, (table, name)
    assert heartbeats_frame([]).height == 0


def test_the_key_order_is_a_lexsort_whether_the_keys_pack_or_not():
    rng = np.random.default_rng(2)
    for span in (3, 1 << 20, 1 << 40):  # packed in one int64; the last: four keys past 62 bits, a lexsort
        keys = [rng.integers(0, span, 500) for _ in range(4)]
        keys[0] = keys[0] % 3  # runs of equal keys to sort within
        within = rng.normal(size=500)
        order, starts = key_order(keys, within=within)
        want = np.lexsort((within, *keys[::-1]))
        assert order.tolist() == want.tolist()
        sk = np.stack([k[want] for k in keys])
        assert starts.tolist() == np.flatnonzero(np.r_[True, (sk[:, 1:] != sk[:, :-1]).any(axis=0)]).tolist()


def test_the_key_order_within_keys_is_a_stable_sort_of_any_values():
    """`within` packed as its dense rank (a float) or its offset (an integer) orders rows as the
    lexsort does: ties, NaN (last, all alike), -0.0 and 0.0 (alike) and inf keep the rows' order;
    an integer range too wide to pack, and none at all, likewise."""
    rng = np.random.default_rng(5)
    for trial in range(600):
        n = int(rng.integers(0, 200))
        keys = [rng.integers(0, [3, 50, 1 << 20][trial % 3], n) for _ in range(int(rng.integers(1, 4)))]
        keys[0] = keys[0] % 2
        kind = trial % 4
        if kind == 0:
            within = rng.integers(-5, 5, n)
        elif kind == 1:
            within = rng.integers(-(1 << 62), 1 << 62, n, dtype=np.int64)
        else:
            within = np.round(rng.normal(size=n), 1)  # many ties
            if kind == 3:
                pick = rng.random(n)
                within[pick < 0.1] = np.nan
                within[(pick >= 0.1) & (pick < 0.2)] = -0.0
                within[(pick >= 0.2) & (pick < 0.3)] = 0.0
                within[(pick >= 0.3) & (pick < 0.35)] = np.inf
        order, starts = key_order(keys, within=within)
        want = np.lexsort((within, *keys[::-1])) if n else np.zeros(0, np.int64)
        assert order.tolist() == want.tolist(), (trial, n, kind)
        sk = np.stack([k[want] for k in keys]) if n else np.zeros((len(keys), 0), np.int64)
        assert starts.tolist() == np.flatnonzero(np.r_[n > 0, (sk[:, 1:] != sk[:, :-1]).any(axis=0)]).tolist()


def test_step_columns_slice_each_step_as_the_frame_does():
    """A pass's released steps as numpy: each step's row range is `iter_steps`' slice, each column
    reads as the slice's own (NULL as NaN or -1, a column the frame lacks likewise), and a step's
    compute at an even share is `compute_at_even_share` of its rows (split, even and unknown)."""
    from analysis.frames import StepColumns, compute_at_even_share

    rows = []
    for step in (3, 4, 5, 7):
        for rank in range(3):
            split = {3: (3, 5, 5), 4: (4, 4, 4), 5: (None, None, None), 7: (2, None, 6)}[step][rank]
            rows.append({"run_id": "r", "attempt": 1 if step == 7 else 0, "step": step, "rank": rank,
                         "fwd_s": 0.01 * (rank + 1), "bwd_s": 0.02, "opt_s": 0.005 if rank else None,
                         "step_s": 0.1 + step, "sample_from": None if split is None else 8 * rank,
                         "sample_to": None if split is None else 8 * rank + split})
    frame = steps_frame(rows).sort("attempt", "step", "rank")
    cols = StepColumns(frame)
    got = list(cols.steps())
    want = list(iter_steps(frame))
    assert [(a, s) for a, s, _, _ in got] == [(a, s) for a, s, _ in want] == [(0, 3), (0, 4), (0, 5), (1, 7)]
    for (_, _, lo, hi), (_, _, part) in zip(got, want):
        assert cols.ints("rank")[lo:hi].tolist() == part["rank"].to_list()
        assert np.array_equal(cols.floats("opt_s")[lo:hi], part["opt_s"].to_numpy().astype(float), equal_nan=True)
        assert np.array_equal(cols.even_share_compute(lo, hi)[0], compute_at_even_share(part), equal_nan=True)
    assert cols.even_share_compute(0, 3)[1] is not None and cols.even_share_compute(3, 6)[1] is None
    assert np.isnan(cols.floats("data_s")).all() and (cols.ints("sample_from")[6:9] == -1).all()
