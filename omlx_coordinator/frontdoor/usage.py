"""Usage per key and model, kept across restarts, and the quotas it is checked against.

Counted per UTC day in `$OMLX_CLUSTER_HOME/usage.json` (written a few seconds after it changes,
and when the gateway stops), so `GET /cluster/usage?since=DAY` sums whole days. A request counts
when it is admitted; its tokens and any error when its generation ends (a request with `n`
choices counts each choice's prompt). The requests-per-minute window is kept in memory only: a
restart forgets at most a minute of it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import math
import os
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass
from pathlib import Path

from omlx_coordinator.frontdoor.keys import Key
from omlx_shared.private_files import write_private

log = logging.getLogger(__name__)

FILE_NAME = "usage.json"
SAVE_SECONDS = 5.0  # how long a change may wait to be written
DAYS_KEPT = 400
ANONYMOUS = "anonymous"  # the name usage is counted under on a gateway without keys


@dataclass
class Counts:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0

    def add(self, other: Counts) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


@dataclass(frozen=True)
class OverQuota:
    """Why a key may not send a request now, and when it may again."""

    message: str
    retry_after: int  # seconds


def today(now: float | None = None) -> str:
    return dt.datetime.fromtimestamp(time.time() if now is None else now,
                                     dt.timezone.utc).date().isoformat()


def parse_since(value: str) -> str:
    """`since` as a UTC day: YYYY-MM-DD, or an ISO date-time (its day); ValueError otherwise."""
    try:
        return dt.date.fromisoformat(value).isoformat()
    except ValueError:
        when = dt.datetime.fromisoformat(value)
        if when.tzinfo is not None:
            when = when.astimezone(dt.timezone.utc)
        return when.date().isoformat()


class Usage:
    """The ledger: {day: {key name: {model: Counts}}}, and each key's recent request times."""

    def __init__(self, path: Path | None):
        self.path = path
        self.days: dict[str, dict[str, dict[str, Counts]]] = {}
        self._recent: dict[str, deque[float]] = defaultdict(deque)
        self._dirty = False
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            raw = json.loads(path.read_text())
            self.days = {day: {key: {model: Counts(**c) for model, c in models.items()}
                               for key, models in keys.items()}
                         for day, keys in raw["days"].items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # Counts are not worth refusing to serve; the damaged file is kept aside.
            log.error("usage file %s is unreadable (%s): counting from zero; the old file is "
                      "kept as %s.bad", path, e, path.name)
            os.replace(path, path.with_suffix(".json.bad"))

    def _counts(self, key: str, model: str) -> Counts:
        self._dirty = True
        return self.days.setdefault(today(), {}).setdefault(key, {}).setdefault(model, Counts())

    # ---- quotas -------------------------------------------------------------------------------

    def check(self, key: Key) -> OverQuota | None:
        """Whether `key` is over a quota now."""
        now = time.time()
        if key.requests_per_minute is not None:
            recent = self._recent[key.name]
            while recent and recent[0] <= now - 60:
                recent.popleft()
            if len(recent) >= key.requests_per_minute:
                wait = math.ceil(recent[0] + 60 - now)
                return OverQuota(f"the key {key.name!r} sent its {key.requests_per_minute} "
                                 f"requests a minute: retry after {wait} s", max(1, wait))
        if key.tokens_per_day is not None:
            used = sum(c.prompt_tokens + c.completion_tokens
                       for c in self.days.get(today(now), {}).get(key.name, {}).values())
            if used >= key.tokens_per_day:
                midnight = dt.datetime.combine(dt.date.fromisoformat(today(now))
                                               + dt.timedelta(days=1), dt.time(),
                                               dt.timezone.utc).timestamp()
                wait = math.ceil(midnight - now)
                return OverQuota(f"the key {key.name!r} used its {key.tokens_per_day} tokens "
                                 f"of today (UTC): retry after {wait} s, at midnight UTC",
                                 max(1, wait))
        return None

    # ---- counting -----------------------------------------------------------------------------

    def admitted(self, key: str, model: str) -> None:
        self._recent[key].append(time.time())
        self._counts(key, model).requests += 1

    def finished(self, key: str, model: str, prompt: int, cached: int, completion: int,
                 failed: bool) -> None:
        c = self._counts(key, model)
        c.prompt_tokens += prompt
        c.cached_tokens += cached
        c.completion_tokens += completion
        c.errors += int(failed)

    def totals(self, since: str = "", key: str | None = None) -> dict[str, dict[str, Counts]]:
        """{key: {model: Counts}} summed over the days from `since` on (all: ""), one key's
        only if `key`."""
        out: dict[str, dict[str, Counts]] = {}
        for day, keys in self.days.items():
            if day < since:
                continue
            for name, models in keys.items():
                if key is not None and name != key:
                    continue
                for model, c in models.items():
                    out.setdefault(name, {}).setdefault(model, Counts()).add(c)
        return out

    # ---- persistence --------------------------------------------------------------------------

    def save(self) -> None:
        if self.path is None or not self._dirty:
            return
        self._dirty = False
        for day in sorted(self.days)[:-DAYS_KEPT]:
            del self.days[day]
        body = {"days": {day: {key: {model: asdict(c) for model, c in models.items()}
                               for key, models in keys.items()}
                         for day, keys in self.days.items()}}
        try:
            write_private(self.path, json.dumps(body))
        except OSError as e:
            self._dirty = True
            log.warning("cannot write usage to %s: %s", self.path, e)

    async def keep_saved(self) -> None:
        """Writes changes every SAVE_SECONDS until cancelled, and once more then."""
        try:
            while True:
                await asyncio.sleep(SAVE_SECONDS)
                self.save()
        finally:
            self.save()
