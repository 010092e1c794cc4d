"""What a node tells the planner, and its metrics, about its machine."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys


def machine_memory() -> int:
    """Total memory in bytes (unified memory on a Mac)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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


def process_footprint() -> tuple[str, int] | None:
    """This process's real memory footprint in bytes, and what measured it: Linux's PSS (its
    share of every page it maps, a page shared by n processes counting 1/n, so weights mapped
    by several processes are not counted twice), macOS's phys_footprint (what Activity Monitor
    shows as a process's Memory). None where neither can be read."""
    if sys.platform == "darwin":
        return "phys_footprint", _darwin().footprint()
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return "pss", int(line.split()[1]) * 1024  # the kernel writes kB
    except OSError:  # not Linux, or a kernel before 4.14
        pass
    return None


def memory_pressure() -> tuple[str, float] | None:
    """How short of memory the machine is, from 0 (not at all) to 1, and what says so: on Linux
    the share of the last 10 s in which some task stalled waiting for memory (PSI, "some
    avg10"), on macOS 1 - kern.memorystatus_level / 100 (that level is the share of memory the
    kernel counts as available). None where neither can be read."""
    if sys.platform == "darwin":
        return "memorystatus_level", 1 - _darwin().memorystatus_level() / 100
    try:
        with open("/proc/pressure/memory") as f:
            some = f.readline().split()  # "some avg10=0.12 avg60=... avg300=... total=..."
        return "psi_some_avg10", float(some[1].partition("=")[2]) / 100
    except (OSError, IndexError, ValueError):  # no PSI (kernel < 4.20, or disabled)
        return None


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

    def footprint(self) -> int:
        info = self.rusage_info()
        if self.lib.proc_pid_rusage(os.getpid(), 0, self.ctypes.byref(info)) != 0:
            raise OSError(self.ctypes.get_errno(), "proc_pid_rusage failed")
        return info.ri_phys_footprint

    def memorystatus_level(self) -> int:
        c = self.ctypes
        level, size = c.c_int(0), c.c_size_t(c.sizeof(c.c_int))
        if self.lib.sysctlbyname(b"kern.memorystatus_level", c.byref(level), c.byref(size),
                                 None, c.c_size_t(0)) != 0:
            raise OSError(c.get_errno(), "sysctlbyname(kern.memorystatus_level) failed")
        return level.value


@functools.cache
def _darwin() -> _Darwin:
    return _Darwin()
