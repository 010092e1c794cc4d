"""Named API keys with roles, allowed models, priority classes and quotas.

`--api-key` keys are admin keys named `api-key-1`, `api-key-2`...; `--keys-file FILE` (TOML)
adds named ones:

    [[key]]
    name = "alice"
    key_sha256 = "9f86d0..."        # or key = "...": the file need not hold the secret itself
    role = "user"                   # user: may generate; admin: also loads, unloads, pins,
                                    # rebalances, reads /cluster/* and everyone's usage
    models = ["qwen3-coder"]        # the models it may use (default: all)
    priority = "batch"              # or "interactive" (default)
    requests_per_minute = 60        # quotas (default: none)
    tokens_per_day = 2000000        # prompt plus completion tokens, per UTC day

The file is read again when it changes, with no restart; a file that no longer parses leaves
the keys as they were and says why in the log. A presented key is hashed and compared with
every key's SHA-256 in constant time, so neither its value nor which key it nearly matched
shows in the timing; only a key's name reaches logs and metrics.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from omlx_coordinator.models.priority import BATCH, INTERACTIVE

log = logging.getLogger(__name__)

ROLES = ("user", "admin")
PRIORITIES = (INTERACTIVE, BATCH)
RELOAD_CHECK_SECONDS = 1.0  # how often a request may stat the keys file
_FIELDS = {"name", "key", "key_sha256", "role", "models", "priority", "requests_per_minute",
           "tokens_per_day"}
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the entry and what to fix."""


@dataclass(frozen=True)
class Key:
    name: str
    digest: bytes  # SHA-256 of the key
    role: str = "admin"
    models: frozenset[str] | None = None  # None: every model
    priority: str = INTERACTIVE
    requests_per_minute: int | None = None
    tokens_per_day: int | None = None

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    def may_use(self, names: tuple[str, ...]) -> bool:
        """Whether a model known by any of `names` (its name and aliases) is allowed."""
        return self.models is None or not self.models.isdisjoint(names)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def admin_keys(keys: list[str] | frozenset[str]) -> list[Key]:
    """The `--api-key` keys: admins, named by their place."""
    return [Key(f"api-key-{i}", digest(k)) for i, k in enumerate(sorted(keys), 1)]


def parse_keys(text: str, source: str = "the keys file") -> list[Key]:
    """The `[[key]]` tables of a keys file; raises KeysFileError saying what is wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise KeysFileError(f"{source} is not valid TOML: {e}") from None
    if set(doc) - {"key"}:
        raise KeysFileError(f"{source}: unknown top-level entries {sorted(set(doc) - {'key'})}; "
                            "write each key as a [[key]] table")
    entries = doc.get("key", [])
    if not isinstance(entries, list):
        raise KeysFileError(f"{source}: write each key as a [[key]] table")
    keys = [_entry(e, i, source) for i, e in enumerate(entries, 1)]
    for attr, what in (("name", "name"), ("digest", "key")):
        seen: set = set()
        for k in keys:
            if getattr(k, attr) in seen:
                raise KeysFileError(f"{source}: two keys have the same {what}"
                                    + (f" ({k.name!r})" if attr == "name" else
                                       f" (one of them is {k.name!r})"))
            seen.add(getattr(k, attr))
    return keys


def _entry(e: object, i: int, source: str) -> Key:
    where = f"{source}, key {i}"
    if not isinstance(e, dict):
        raise KeysFileError(f"{where}: must be a [[key]] table")
    if unknown := set(e) - _FIELDS:
        raise KeysFileError(f"{where}: unknown field(s) {sorted(unknown)}; a key has "
                            f"{', '.join(sorted(_FIELDS))}")
    name = e.get("name")
    if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name):
        raise KeysFileError(f"{where}: 'name' must be a word without spaces (it names the key "
                            "in logs, metrics and usage)")
    where = f"{source}, key {name!r}"
    if ("key" in e) == ("key_sha256" in e):
        raise KeysFileError(f"{where}: give exactly one of 'key' and 'key_sha256'")
    if "key" in e:
        if not isinstance(e["key"], str) or not e["key"].strip():
            raise KeysFileError(f"{where}: 'key' must be a non-empty string")
        key_digest = digest(e["key"])
    else:
        if not isinstance(e["key_sha256"], str) or not _HEX64.fullmatch(e["key_sha256"]):
            raise KeysFileError(f"{where}: 'key_sha256' must be 64 hex digits (`printf %s KEY "
                                "| sha256sum`)")
        key_digest = bytes.fromhex(e["key_sha256"])
    role, priority = e.get("role", "user"), e.get("priority", INTERACTIVE)
    if role not in ROLES:
        raise KeysFileError(f"{where}: 'role' must be one of {', '.join(ROLES)}, got {role!r}")
    if priority not in PRIORITIES:
        raise KeysFileError(f"{where}: 'priority' must be one of {', '.join(PRIORITIES)}, "
                            f"got {priority!r}")
    models = e.get("models")
    if models is not None and not (isinstance(models, list)
                                   and all(isinstance(m, str) and m for m in models)):
        raise KeysFileError(f"{where}: 'models' must be a list of model names")
    quotas = {}
    for q in ("requests_per_minute", "tokens_per_day"):
        v = e.get(q)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise KeysFileError(f"{where}: {q!r} must be a positive whole number")
        quotas[q] = v
    return Key(name, key_digest, role, frozenset(models) if models is not None else None,
               priority, **quotas)


class KeyRing:
    """The keys a gateway takes: the `--api-key` admins and the keys file's, read again when the
    file changes. Empty: the gateway is open (only allowed on loopback)."""

    def __init__(self, api_keys: list[str] | frozenset[str] = (), path: Path | None = None):
        self._fixed = admin_keys(list(api_keys))
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        self._keys = list(self._fixed)
        if path is not None:
            self._keys = self._fixed + self._read(path)  # a bad file at start: the caller's error

    @property
    def keys(self) -> list[Key]:
        self._reload()
        return self._keys

    @property
    def open(self) -> bool:
        return not self.keys

    def identify(self, presented: str) -> Key | None:
        """The key `presented` is, or None. Every key is compared, in constant time each."""
        found = None
        d = digest(presented)
        for k in self.keys:
            if hmac.compare_digest(d, k.digest):
                found = k
        return found

    def _read(self, path: Path) -> list[Key]:
        st = path.stat()
        self._stamp = (st.st_mtime_ns, st.st_size)
        keys = parse_keys(path.read_text(), str(path))
        names = {k.name for k in self._fixed}
        if clash := names & {k.name for k in keys}:
            raise KeysFileError(f"{path}: the name(s) {sorted(clash)} are the --api-key keys' "
                                "own; pick others")
        return keys

    def _reload(self) -> None:
        if self.path is None or time.monotonic() - self._checked < RELOAD_CHECK_SECONDS:
            return
        with self._lock:
            self._checked = time.monotonic()
            try:
                st = os.stat(self.path)
                if (st.st_mtime_ns, st.st_size) == self._stamp:
                    return
                keys = self._read(self.path)
            except (OSError, KeysFileError) as e:
                if self._stamp is not None:
                    log.error("keeping the keys as they were: %s", e)
                self._stamp = None  # said once; tried again at the next change
                return
            self._keys = self._fixed + keys
            log.info("keys file %s read again: %d key(s) (%s)", self.path, len(keys),
                     ", ".join(k.name for k in keys))
