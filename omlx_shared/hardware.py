"""What a node tells the planner, and its metrics, about its machine."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys

# Linux PSI "some avg10" grades: a tenth of the time with a task stalled on memory is where the
# rebalancer starts shedding layers (omlx_coordinator/telemetry/rebalancer.py); stalled 40% of the time,
# the machine is thrashing.
PSI_WARN = 0.10
PSI_CRITICAL = 0.40
# kern.memorystatus_vm_pressure_level's values (<sys/kern_memorystatus.h> kVMPressure*).
_DARWIN_PRESSURE = {1: "normal", 2: "warn", 4: "critical"}


def machine_memory() -> int:
    """Total memory in bytes (unified memory on a Mac)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@functools.cache
def mlx_on_cpu() -> bool:
    """Whether MLX runs this machine's workers on its CPU (and so dequantizes a quantized
    model, omlx_node/stage.py), told without importing MLX: Apple silicon runs Metal, and
    elsewhere only MLX's CUDA build has a GPU."""
    if sys.platform == "darwin":
        return False
    from importlib import metadata

    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions()}
    return not any(n.startswith("mlx-cuda") for n in names)


def chip() -> str:
    """The processor's marketing name where the OS tells it (e.g. "Apple M4 Max")."""
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], text=True,
                                  capture_output=True, timeout=5).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def process_footprint(pid: int | None = None) -> tuple[str, int] | None:
    """A process's real memory footprint in bytes (this process's by default), and what
    measured it: Linux's PSS (its share of every page it maps, a page shared by n processes
    counting 1/n, so weights mapped by several processes are not counted twice), macOS's
    phys_footprint (what Activity Monitor shows as a process's Memory). None where neither can
    be read or the process is gone (macOS raises OSError then)."""
    if sys.platform == "darwin":
        return "phys_footprint", _darwin().footprint(pid or os.getpid())
    try:
        with open(f"/proc/{pid or 'self'}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return "pss", int(line.split()[1]) * 1024  # the kernel writes kB
    except OSError:  # not Linux, a kernel before 4.14, or no such process
        pass
    return None


def available_memory() -> int | None:
    """Bytes the OS could give a process now without swapping: Linux's MemAvailable (free
    memory plus the page cache and reclaimable slabs it can drop), on macOS the share of memory
    kern.memorystatus_level counts as available (free, inactive and purgeable pages). None
    where neither can be read."""
    if sys.platform == "darwin":
        return machine_memory() * _darwin().sysctl_int(b"kern.memorystatus_level") // 100
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_pressure() -> tuple[str, float] | None:
    """How short of memory the machine is, from 0 (not at all) to 1, and what says so: on Linux
    the share of the last 10 s in which some task stalled waiting for memory (PSI, "some
    avg10"), on macOS 1 - kern.memorystatus_level / 100 (that level is the share of memory the
    kernel counts as available). None where neither can be read."""
    if sys.platform == "darwin":
        return "memorystatus_level", 1 - _darwin().sysctl_int(b"kern.memorystatus_level") / 100
    try:
        with open("/proc/pressure/memory") as f:
            some = f.readline().split()  # "some avg10=0.12 avg60=... avg300=... total=..."
        return "psi_some_avg10", float(some[1].partition("=")[2]) / 100
    except (OSError, IndexError, ValueError):  # no PSI (kernel < 4.20, or disabled)
        return None


def pressure_level() -> str:
    """The machine's memory pressure as the OS grades it: "normal", "warn" or "critical"; ""
    where it cannot be read. macOS says it itself (kern.memorystatus_vm_pressure_level, what
    Activity Monitor's pressure graph and the kernel's memory-pressure notifications use); on
    Linux it is graded from PSI's stall share (memory_pressure)."""
    if sys.platform == "darwin":
        return _DARWIN_PRESSURE.get(_darwin().sysctl_int(b"kern.memorystatus_vm_pressure_level"),
                                    "normal")
    reading = memory_pressure()
    if reading is None:
        return ""
    stalled = reading[1]
    return ("critical" if stalled >= PSI_CRITICAL else "warn" if stalled >= PSI_WARN
            else "normal")


class _Darwin:
    """libSystem's calls through ctypes, loaded on first use: only on macOS."""

    def __init__(self) -> None:
        import ctypes

        self.ctypes = ctypes
        self.lib = ctypes.CDLL("/usr/lib/libSystem.B.dylib", use_errno=True)
        u64 = ctypes.c_uint64

        class RusageInfoV0(ctypes.Structure):  # <sys/resource.h>, RUSAGE_INFO_V0
            _fields_ = [("ri_uuid", ctypes.c_uint8 * 16), ("ri_user_time", u64),
                        ("ri_system_time", u64), ("ri_pkg_idle_wkups", u64),
                        ("ri_interrupt_wkups", u64), ("ri_pageins", u64),
                        ("ri_wired_size", u64), ("ri_resident_size", u64),
                        ("ri_phys_footprint", u64), ("ri_proc_start_abstime", u64),
                        ("ri_proc_exit_abstime", u64)]

        self.rusage_info = RusageInfoV0

    def footprint(self, pid: int) -> int:
        info = self.rusage_info()
        if self.lib.proc_pid_rusage(pid, 0, self.ctypes.byref(info)) != 0:
            raise OSError(self.ctypes.get_errno(), "proc_pid_rusage failed")
        return info.ri_phys_footprint

    def sysctl_int(self, name: bytes) -> int:
        c = self.ctypes
        value, size = c.c_int(0), c.c_size_t(c.sizeof(c.c_int))
        if self.lib.sysctlbyname(name, c.byref(value), c.byref(size), None, c.c_size_t(0)) != 0:
            raise OSError(c.get_errno(), f"sysctlbyname({name.decode()}) failed")
        return value.value


@functools.cache
def _darwin() -> _Darwin:
    return _Darwin()
