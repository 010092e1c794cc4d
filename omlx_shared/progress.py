"""Progress of a long step: a bar on a terminal, a log line every tenth of the way elsewhere.

A bar redrawn with carriage returns is noise in a log file, a launchd log or a test's pipe,
and silence there is worse (a 93 MB download or a weight transfer looks hung): so off a
terminal the same progress becomes a few plain lines.
"""

from __future__ import annotations

import logging
import os
import sys

from tqdm.auto import tqdm

log = logging.getLogger("omlx.progress")

STEPS = 10  # lines off a terminal: one per tenth


def human_bytes(n: float) -> str:
    """1.50 GiB, 93.00 MiB, 12.00 KiB, 0 B: binary units, as memory and disks are sold."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def on_terminal() -> bool:
    return sys.stderr.isatty()


class ProgressLines:
    """Logs `what: 40% (37.20 MiB of 93.00 MiB)` (or `(12 of 30 tensors)`) each time another
    tenth is done; the total
    may grow while it runs (a download learns its files' sizes one by one)."""

    def __init__(self, what: str, total: float = 0, unit: str = "B") -> None:
        self.what, self.total, self.unit = what, total, unit
        self._logged = 0  # tenths already logged

    def update(self, done: float, total: float | None = None) -> None:
        self.total = total if total is not None else self.total
        if not self.total:
            return
        tenths = min(STEPS, int(done * STEPS // self.total))
        if tenths > self._logged:
            self._logged = tenths
            if self.unit == "B":
                amount = f"{human_bytes(done)} of {human_bytes(self.total)}"
            else:
                amount = f"{done:.0f} of {self.total:.0f} {self.unit}"
            log.info("%s: %d%% (%s)", self.what, tenths * 100 // STEPS, amount)


def logged_tqdm(what: str) -> type[tqdm]:
    """A tqdm class (for huggingface_hub's `tqdm_class`) that draws its bars on a terminal and,
    elsewhere, logs the byte counts of `what` as ProgressLines."""
    terminal = on_terminal()

    class Bar(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            if not terminal:
                kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115 (closed in close())
            super().__init__(*args, **kwargs)
            self._lines = (ProgressLines(what, self.total or 0) if not terminal
                           and kwargs.get("unit") == "B" else None)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            if self._lines is not None:
                self._lines.update(self.n, self.total or 0)
            return shown

        def close(self) -> None:
            super().close()
            if not terminal and self.fp is not None and not self.fp.closed:
                self.fp.close()

    return Bar
