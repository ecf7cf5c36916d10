"""device_health rows from the wire into the `device_health` table of a real Storage:
one row per sample, the batch's run/rank/node added, "not measured" stored as NULL."""

from __future__ import annotations

import numpy as np

from agent import wire
from collector.ingest.decode import decode
from tests.unit.collector.collector_batches import columns, make_batch


def test_device_health_rows_are_stored_with_nulls(storage):
    nan_null = np.array([wire.NULL_F64_BITS], "<i8").view("<f8")[0]
    cols = columns(wire.DEVICE_HEALTH, 2, ts=[10.0, 11.0], step=[5, 6], gpu_index=[3, -1],
                   temperature_c=[81.5, nan_null], power_w=[612.5, nan_null], sm_clock_mhz=[1410, -1],
                   throttle_reasons=[0x40, -1], ecc_uncorrectable=[2, -1], retired_pages=[1, -1],
                   mem_available_bytes=[1 << 30, 2 << 30], mem_total_bytes=[8 << 30, 8 << 30], cpu_s=[1.25, 2.5])
    result = storage.ingest_blocking(decode(make_batch("dh", 3, 0, sections={wire.DEVICE_HEALTH: (2, cols)})))
    assert result.accepted == 2 and not result.duplicate
    with storage.cursor() as cur:
        rows = cur.execute("""SELECT run_id, rank, node, ts, step, gpu_index, temperature_c, power_w, sm_clock_mhz,
                                     throttle_reasons, ecc_uncorrectable, retired_pages, mem_available_bytes,
                                     mem_total_bytes, cpu_s FROM device_health ORDER BY ts""").fetchall()
    assert rows == [
        ("dh", 3, "node1", 10.0, 5, 3, 81.5, 612.5, 1410, 0x40, 2, 1, 1 << 30, 8 << 30, 1.25),
        ("dh", 3, "node1", 11.0, 6, None, None, None, None, None, None, None, 2 << 30, 8 << 30, 2.5)]
