"""Device health, sampled on the agent's thread once per heartbeat.

Each heartbeat the flusher (never the training thread) takes one sample into the
`device_health` record kind (agent/wire.py), stored as the `device_health` table:

- on a GPU, through NVML (`nvidia-ml-py`, imported as `pynvml`, lazily and
  optionally: the agent stays stdlib-only): temperature (C), power (W), SM clock
  (MHz), the clock event ("throttle") reason bits, volatile uncorrectable ECC
  errors, and retired pages (both causes);
- on every host: memory pressure (/proc/meminfo `MemAvailable` and `MemTotal`)
  and this process's CPU time (`os.times()`, user + system).

What a host cannot tell is None (NULL in the table): the GPU columns without
NVML or a device, ECC on a board without it. A call that fails once is not
retried for that metric (NotSupported stays NotSupported), so a sample costs a
few NVML calls and one small file read, ~0.1 ms.

Which GPU: `gpu_index` when given, else the rank's `LOCAL_RANK` (default 0),
mapped through `CUDA_VISIBLE_DEVICES` (NVML numbers all the host's GPUs and
ignores it; an entry that is a UUID is looked up by UUID). The row's
`gpu_index` is NVML's (the host's) index, NULL for a device named by UUID.

On a GPU machine, one command shows a sample:

    python -m agent.device_health --probe
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Callable

log = logging.getLogger("llmwatch.agent")

# The sample's fields, in wire.SCHEMA[DEVICE_HEALTH] order after (ts, step).
FIELDS = ("gpu_index", "temperature_c", "power_w", "sm_clock_mhz", "throttle_reasons", "ecc_uncorrectable",
          "retired_pages", "mem_available_bytes", "mem_total_bytes", "cpu_s")

# nvml.h values, used when the module does not define the name
_NVML_TEMPERATURE_GPU = 0
_NVML_CLOCK_SM = 1
_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_NVML_VOLATILE_ECC = 0
_NVML_RETIRED_CAUSES = (0, 1)  # multiple single-bit ECC errors, double-bit ECC errors


def _visible_device(local_index: int) -> str | int:
    """The NVML index (or UUID) of CUDA's device `local_index`."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return local_index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if local_index >= len(entries):
        return local_index
    entry = entries[local_index]
    return int(entry) if entry.isdigit() else entry


def _meminfo(path: str) -> tuple[int | None, int | None]:
    """(MemAvailable, MemTotal) in bytes from a /proc/meminfo file; None when unknown."""
    try:
        with open(path, "rb") as f:
            text = f.read(8192)
    except OSError:
        return None, None
    values = {}
    for line in text.split(b"\n"):
        key, _, rest = line.partition(b":")
        if key in (b"MemAvailable", b"MemTotal"):
            parts = rest.split()
            if parts and parts[0].isdigit():
                scale = 1024 if len(parts) > 1 and parts[1].lower() == b"kb" else 1
                values[key] = int(parts[0]) * scale
    return values.get(b"MemAvailable"), values.get(b"MemTotal")


class DeviceHealthSampler:
    """One call of `sample()` per heartbeat, on one thread. Never raises.

    `nvml`: the NVML module (tests pass a fake); None imports `pynvml` on first use,
    and no GPU columns are sampled when that fails. `meminfo_path`, `cpu_times`:
    injectable for tests."""

    def __init__(self, gpu_index: int | None = None, *, nvml=None, meminfo_path: str = "/proc/meminfo",
                 cpu_times: Callable[[], os.times_result] = os.times, use_nvml: bool = True) -> None:
        self._gpu_index = gpu_index if gpu_index is not None else int(os.environ.get("LOCAL_RANK", "0") or 0)
        self._nvml = nvml
        self._use_nvml = use_nvml
        self._meminfo_path = meminfo_path
        self._cpu_times = cpu_times
        self._handle = None
        self._opened = False
        self._failed: set[str] = set()  # NVML metrics that failed once: not asked again
        self.nvml_error = ""  # why there are no GPU columns (empty: there are, or NVML was not tried yet)

    # -- NVML -------------------------------------------------------------
    def _open_nvml(self) -> None:
        self._opened = True
        if not self._use_nvml:
            self.nvml_error = "NVML disabled"
            return
        try:
            nvml = self._nvml
            if nvml is None:
                import pynvml as nvml  # optional: nvidia-ml-py
            nvml.nvmlInit()
            device = _visible_device(self._gpu_index)
            if isinstance(device, str):
                self._handle = nvml.nvmlDeviceGetHandleByUUID(device)
                self._gpu_index = None  # the host's index of that UUID is not asked for
            else:
                self._handle = nvml.nvmlDeviceGetHandleByIndex(device)
                self._gpu_index = device
            self._nvml = nvml
        except Exception as e:  # noqa: BLE001 - no pynvml, no driver, no such device: CPU columns only
            self._handle = None
            self.nvml_error = f"{type(e).__name__}: {e}"

    def _call(self, metric: str, fn: Callable[[], object]):
        if metric in self._failed:
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - NotSupported, a driver hiccup: this metric stays NULL
            self._failed.add(metric)
            log.debug("llmwatch agent: NVML %s unavailable: %r", metric, e)
            return None

    def _throttle_reasons(self, nvml, handle) -> int:
        # renamed "clocks event reasons" in NVML 12.2; the old name is deprecated
        fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is None:
            fn = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(handle))

    def _gpu(self) -> tuple:
        if not self._opened:
            self._open_nvml()
        nvml, h = self._nvml, self._handle
        if h is None:
            return (None,) * 7
        const = lambda name, default: getattr(nvml, name, default)  # noqa: E731
        temp = self._call("temperature", lambda: float(nvml.nvmlDeviceGetTemperature(
            h, const("NVML_TEMPERATURE_GPU", _NVML_TEMPERATURE_GPU))))
        power = self._call("power", lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)  # mW
        clock = self._call("sm_clock", lambda: int(nvml.nvmlDeviceGetClockInfo(h, const("NVML_CLOCK_SM",
                                                                                          _NVML_CLOCK_SM))))
        reasons = self._call("throttle_reasons", lambda: self._throttle_reasons(nvml, h))
        ecc = self._call("ecc", lambda: int(nvml.nvmlDeviceGetTotalEccErrors(
            h, const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", _NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            const("NVML_VOLATILE_ECC", _NVML_VOLATILE_ECC))))
        causes = (const("NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", _NVML_RETIRED_CAUSES[0]),
                  const("NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERRORS", _NVML_RETIRED_CAUSES[1]))
        retired = self._call("retired_pages", lambda: sum(len(nvml.nvmlDeviceGetRetiredPages(h, c)) for c in causes))
        return self._gpu_index, temp, power, clock, reasons, ecc, retired

    def hw_id(self) -> str | None:
        """The GPU's NVML UUID ("GPU-..."): the hardware a node's history across runs follows
        (collector/read/fleet.py); None without NVML or a device."""
        if not self._opened:
            self._open_nvml()
        if self._handle is None:
            return None
        uuid = self._call("uuid", lambda: self._nvml.nvmlDeviceGetUUID(self._handle))
        if isinstance(uuid, bytes):
            uuid = uuid.decode("ascii", "replace")
        return str(uuid) if uuid else None

    # -- the sample ---------------------------------------------------------
    def sample(self) -> tuple:
        """The values of `FIELDS`, None where not measured."""
        try:
            gpu = self._gpu()
        except Exception as e:  # noqa: BLE001
            gpu = (None,) * 7
            self.nvml_error = f"{type(e).__name__}: {e}"
        available, total = _meminfo(self._meminfo_path)
        try:
            t = self._cpu_times()
            cpu_s = float(t.user + t.system)
        except Exception:  # noqa: BLE001
            cpu_s = None
        return (*gpu, available, total, cpu_s)

    def close(self) -> None:
        if self._handle is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._handle = None


def main(argv: list[str] | None = None) -> int:
    """`python -m agent.device_health --probe [--gpu-index N]`: print one sample as JSON."""
    ap = argparse.ArgumentParser(prog="python -m agent.device_health", description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe", action="store_true", help="print one sample as JSON and exit")
    ap.add_argument("--gpu-index", type=int, default=None, help="CUDA device index (default: LOCAL_RANK or 0)")
    args = ap.parse_args(argv)
    if not args.probe:
        ap.print_help()
        return 2
    sampler = DeviceHealthSampler(args.gpu_index)
    try:
        out = dict(zip(FIELDS, sampler.sample()))
    finally:
        sampler.close()
    out["nvml"] = sampler.nvml_error or "ok"
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
