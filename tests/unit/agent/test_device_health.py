"""The device-health sampler: NVML through a fake `pynvml` with the real function names,
the host (CPU) path on this machine for real, and the rows the agent ships.

No GPU is on the test machine: the NVML path is only exercised against the fake.
On a GPU machine, `python -m agent.device_health --probe` prints a real sample."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest

from agent import Agent, AgentConfig, wire
from agent.device_health import FIELDS, DeviceHealthSampler, main
from tests.unit.agent.spooled import closed_port, spooled_batches


class NVMLError(Exception):
    pass


def fake_nvml(*, new_reasons_name: bool = True, ecc_supported: bool = True, init_fails: bool = False):
    """A module with pynvml's names and calling conventions (values in NVML's units)."""
    calls: list[tuple] = []
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = NVMLError
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.NVML_CLOCK_SM = 1
    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    nvml.NVML_VOLATILE_ECC = 0
    nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERRORS = 1
    nvml.calls = calls
    nvml.ecc = 0

    def record(name, *args):
        calls.append((name, *args))

    def nvmlInit():
        record("nvmlInit")
        if init_fails:
            raise NVMLError("Driver Not Loaded")

    def nvmlDeviceGetHandleByIndex(i):
        record("nvmlDeviceGetHandleByIndex", i)
        return ("handle", i)

    def nvmlDeviceGetHandleByUUID(uuid):
        record("nvmlDeviceGetHandleByUUID", uuid)
        return ("handle", uuid)

    def nvmlDeviceGetTemperature(h, sensor):
        record("nvmlDeviceGetTemperature", h, sensor)
        assert sensor == nvml.NVML_TEMPERATURE_GPU
        return 83

    def nvmlDeviceGetPowerUsage(h):
        record("nvmlDeviceGetPowerUsage", h)
        return 612_500  # milliwatts

    def nvmlDeviceGetClockInfo(h, clock):
        record("nvmlDeviceGetClockInfo", h, clock)
        assert clock == nvml.NVML_CLOCK_SM
        return 1410

    def reasons(h):
        record("reasons", h)
        return 0x40 | 0x1  # HwThermalSlowdown | GpuIdle

    def nvmlDeviceGetTotalEccErrors(h, error_type, counter_type):
        record("nvmlDeviceGetTotalEccErrors", h, error_type, counter_type)
        if not ecc_supported:
            raise NVMLError("Not Supported")
        assert (error_type, counter_type) == (1, 0)  # uncorrected, volatile
        return nvml.ecc

    def nvmlDeviceGetRetiredPages(h, cause):
        record("nvmlDeviceGetRetiredPages", h, cause)
        return [0x1000] * (1 if cause == 0 else 2)

    def nvmlShutdown():
        record("nvmlShutdown")

    def nvmlDeviceGetUUID(h):
        record("nvmlDeviceGetUUID", h)
        return b"GPU-8a9b" if isinstance(h, tuple) and h[1] == 3 else "GPU-other"

    for fn in (nvmlDeviceGetUUID, nvmlInit, nvmlDeviceGetHandleByIndex, nvmlDeviceGetHandleByUUID, nvmlDeviceGetTemperature,
               nvmlDeviceGetPowerUsage, nvmlDeviceGetClockInfo, nvmlDeviceGetTotalEccErrors,
               nvmlDeviceGetRetiredPages, nvmlShutdown):
        setattr(nvml, fn.__name__, fn)
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = reasons
    if new_reasons_name:
        nvml.nvmlDeviceGetCurrentClocksEventReasons = reasons
    return nvml


@pytest.fixture
def no_cuda_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_nvml_sample_through_the_real_function_names(monkeypatch, no_cuda_env):
    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # what `import pynvml` finds
    nvml.ecc = 2
    sampler = DeviceHealthSampler(gpu_index=3)
    got = dict(zip(FIELDS, sampler.sample()))
    assert {k: got[k] for k in FIELDS[:7]} == {
        "gpu_index": 3, "temperature_c": 83.0, "power_w": 612.5, "sm_clock_mhz": 1410,
        "throttle_reasons": 0x41, "ecc_uncorrectable": 2, "retired_pages": 3}
    assert ("nvmlDeviceGetHandleByIndex", 3) in nvml.calls and sampler.nvml_error == ""
    nvml.ecc = 5
    assert dict(zip(FIELDS, sampler.sample()))["ecc_uncorrectable"] == 5
    assert [c[0] for c in nvml.calls].count("nvmlInit") == 1  # opened once
    sampler.close()
    assert nvml.calls[-1] == ("nvmlShutdown",)


def test_the_older_throttle_reasons_name_is_used_when_the_new_one_is_absent(no_cuda_env):
    nvml = fake_nvml(new_reasons_name=False)
    assert not hasattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons")
    got = dict(zip(FIELDS, DeviceHealthSampler(0, nvml=nvml).sample()))
    assert got["throttle_reasons"] == 0x41


def test_local_rank_maps_through_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    nvml = fake_nvml()
    got = dict(zip(FIELDS, DeviceHealthSampler(nvml=nvml).sample()))
    assert ("nvmlDeviceGetHandleByIndex", 6) in nvml.calls and got["gpu_index"] == 6
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    nvml = fake_nvml()
    got = dict(zip(FIELDS, DeviceHealthSampler(nvml=nvml).sample()))
    assert ("nvmlDeviceGetHandleByUUID", "GPU-bbbb") in nvml.calls
    assert got["gpu_index"] is None and got["temperature_c"] == 83.0


def test_an_unsupported_metric_is_null_and_not_asked_again(no_cuda_env):
    nvml = fake_nvml(ecc_supported=False)
    sampler = DeviceHealthSampler(0, nvml=nvml)
    for _ in range(3):
        got = dict(zip(FIELDS, sampler.sample()))
        assert got["ecc_uncorrectable"] is None and got["temperature_c"] == 83.0
    assert [c[0] for c in nvml.calls].count("nvmlDeviceGetTotalEccErrors") == 1


def test_no_driver_or_no_pynvml_leaves_the_host_columns(monkeypatch, no_cuda_env):
    sampler = DeviceHealthSampler(0, nvml=fake_nvml(init_fails=True))
    got = dict(zip(FIELDS, sampler.sample()))
    assert all(got[k] is None for k in FIELDS[:7]) and "Driver Not Loaded" in sampler.nvml_error
    assert got["mem_total_bytes"] > 0
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    sampler = DeviceHealthSampler(0)
    got = dict(zip(FIELDS, sampler.sample()))
    assert got["temperature_c"] is None and "pynvml" in sampler.nvml_error and got["cpu_s"] > 0.0


def test_host_path_on_this_machine():
    """The CPU path for real: /proc/meminfo and this process's CPU time."""
    sampler = DeviceHealthSampler(0, use_nvml=False)
    first = dict(zip(FIELDS, sampler.sample()))
    assert 0 < first["mem_available_bytes"] <= first["mem_total_bytes"]
    with open("/proc/meminfo") as f:
        total_kb = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert first["mem_total_bytes"] == total_kb * 1024
    x = 0
    for i in range(2_000_000):  # spend some CPU time
        x += i * i
    second = dict(zip(FIELDS, sampler.sample()))
    assert second["cpu_s"] > first["cpu_s"] >= 0.0 and x > 0


def test_meminfo_file_is_parsed_and_a_missing_one_is_null(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       16384000 kB\nMemFree:  100 kB\nMemAvailable:    1024000 kB\n")
    got = dict(zip(FIELDS, DeviceHealthSampler(0, use_nvml=False, meminfo_path=str(path)).sample()))
    assert (got["mem_available_bytes"], got["mem_total_bytes"]) == (1024000 * 1024, 16384000 * 1024)
    got = dict(zip(FIELDS, DeviceHealthSampler(0, use_nvml=False, meminfo_path=str(tmp_path / "no")).sample()))
    assert got["mem_available_bytes"] is None and got["mem_total_bytes"] is None


def test_probe_prints_one_sample(capsys):
    assert main(["--probe"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(FIELDS) <= set(out) and out["mem_total_bytes"] > 0
    assert out["nvml"]  # "ok", or why there are no GPU columns (none here)


def test_the_agent_ships_one_sample_per_heartbeat(tmp_path, monkeypatch, no_cuda_env):
    nvml = fake_nvml()
    nvml.ecc = 1
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    cfg = AgentConfig(url=f"http://127.0.0.1:{closed_port()}", spool_dir=str(tmp_path), capacity=16,
                      timeout_s=0.5, gpu_index=2)
    agent = Agent(cfg, run_id="r1", rank=1, node="n1", clock=lambda: 1_700_000_000.0)
    agent.set_phase("forward", 7)
    agent.flush(1.0)  # the first cycle heartbeats: one sample
    agent.close()
    batches = spooled_batches(tmp_path)
    rows = [dict(zip(cols, vals)) for b in batches if (cols := b.columns.get(wire.DEVICE_HEALTH))
            for vals in zip(*(list(v) for v in cols.values()))]
    assert len(rows) == 1
    (row,) = rows
    assert (row["ts"], row["step"], row["gpu_index"], row["temperature_c"], row["power_w"]) == (
        1_700_000_000.0, 7, 2, 83.0, 612.5)
    assert (row["ecc_uncorrectable"], row["retired_pages"], row["throttle_reasons"]) == (1, 3, 0x41)
    assert row["mem_total_bytes"] > 0 and row["cpu_s"] >= 0.0
    assert batches[0].header["stats"]["recorded"]["device_health"] == 1


def test_a_host_without_nvml_ships_null_gpu_columns(tmp_path, monkeypatch, no_cuda_env):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    cfg = AgentConfig(url=f"http://127.0.0.1:{closed_port()}", spool_dir=str(tmp_path), capacity=16,
                      timeout_s=0.5)
    agent = Agent(cfg, run_id="r1", rank=0, node="n0")
    agent.flush(1.0)
    agent.close()
    batch = spooled_batches(tmp_path)[0]
    cols = batch.columns[wire.DEVICE_HEALTH]
    assert list(cols["gpu_index"]) == [wire.NOT_MEASURED] and list(cols["ecc_uncorrectable"]) == [-1]
    (temp,) = cols["temperature_c"].cast("B").cast("q")  # the float NULL is a bit pattern
    assert temp == wire.NULL_F64_BITS and math.isnan(cols["temperature_c"][0])
    assert cols["mem_total_bytes"][0] > 0


def test_device_health_off_ships_no_samples(tmp_path):
    cfg = AgentConfig(url=f"http://127.0.0.1:{closed_port()}", spool_dir=str(tmp_path), capacity=16,
                      timeout_s=0.5, device_health=False)
    agent = Agent(cfg, run_id="r1", rank=0, node="n0")
    agent.flush(1.0)
    agent.close()
    batch = spooled_batches(tmp_path)[0]
    assert wire.HEARTBEAT in batch.columns and wire.DEVICE_HEALTH not in batch.columns


def test_the_hardware_id_is_the_gpus_nvml_uuid_and_none_without_nvml(monkeypatch, no_cuda_env):
    """What a node's history across runs follows (collector/read/fleet.py): bytes or str from NVML."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    assert DeviceHealthSampler(gpu_index=3).hw_id() == "GPU-8a9b"
    assert DeviceHealthSampler(gpu_index=1).hw_id() == "GPU-other"
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(init_fails=True))
    assert DeviceHealthSampler(gpu_index=3).hw_id() is None
