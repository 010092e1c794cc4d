"""Which models a cluster serves and how: names, aliases, pinning, idle TTL, replicas.

From the command line (`--model NAME=PATH` repeated, `--alias`, `--pin`, `--ttl`, `--replicas`)
or a small TOML file (`--models-config`, the format below). Pure: paths are resolved and checked
by the caller (omlx_shared/model_spec.py), so a config naming a missing folder fails at start.

    [[model]]
    name = "coder"                 # what clients send as "model"
    path = "/models/Qwen2.5-Coder-7B-4bit"
    aliases = ["gpt-4o-mini"]      # other names that reach it
    pin = true                     # never evicted
    ttl = 1800                     # seconds idle before it is unloaded (0: never)
    replicas = "auto"              # an int, or "auto" (omlx_coordinator/models/placement.py)
    max_queue = 32                 # requests held at once, past it a 429 (default: --max-queue)
    speculative = "off"            # off, ngram, auto or draft=PATH (default: the node's --speculative)
    parallel = "tensor"            # auto, pipeline, tensor or tensor-pipeline (default: --parallel)
    kind = "rerank"                # chat, embed, rerank or transcribe (default: read from the
                                   # folder, omlx_shared/model_kinds.py)
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from omlx_shared.model_kinds import KINDS
from omlx_shared.parallel_modes import PARALLEL
from omlx_shared.speculative_modes import MODES, check_mode

Replicas = int | str  # a count, or "auto"


class ModelConfigError(ValueError):
    """A model setting that makes no sense; the message names it and says what is expected."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    spec: str  # a folder, or a name in the local model store (resolved by the caller)
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    ttl_seconds: float = 0.0  # idle time before it is unloaded; 0: never
    replicas: Replicas = 1
    split: list[int] | None = field(default=None, compare=False)
    max_queue: int | None = None  # requests held at once (admission.py); None: the gateway's
    slots: int | None = None  # sequences its replicas decode at once (priority.py); None: default
    batch_share: float = 0.5  # of the slots, what batch-class requests may run in
    speculative: str = ""  # a speculative_modes mode; "": the node's --speculative
    parallel: str = ""  # omlx_shared/parallel_modes.py's; "": the gateway's --parallel
    kind: str = ""  # a model_kinds kind; "": read from the folder

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ModelConfigError(f"model name {self.name!r}: must be non-empty, no spaces")
        if self.ttl_seconds < 0:
            raise ModelConfigError(f"model {self.name}: ttl must be >= 0 seconds")
        if self.replicas != "auto" and not (isinstance(self.replicas, int)
                                            and self.replicas >= 1):
            raise ModelConfigError(f"model {self.name}: replicas must be a positive integer "
                                   f"or \"auto\", got {self.replicas!r}")
        if self.max_queue is not None and not (isinstance(self.max_queue, int)
                                               and not isinstance(self.max_queue, bool)
                                               and self.max_queue >= 1):
            raise ModelConfigError(f"model {self.name}: max_queue must be a positive integer, "
                                   f"got {self.max_queue!r}")
        if self.kind and self.kind not in KINDS:
            raise ModelConfigError(f"model {self.name}: kind must be one of {', '.join(KINDS)}, "
                                   f"got {self.kind!r}")
        if self.speculative:
            try:
                check_mode(self.speculative)
            except ValueError as e:
                raise ModelConfigError(f"model {self.name}: {e}") from e
        if self.parallel and self.parallel not in PARALLEL:
            raise ModelConfigError(f"model {self.name}: parallel must be one of "
                                   f"{', '.join(PARALLEL)}, got {self.parallel!r}")


def parse_model_arg(text: str) -> tuple[str | None, str]:
    """`NAME=PATH` or `PATH` (the name is then the folder's): (name or None, spec)."""
    name, sep, spec = text.partition("=")
    # A path may itself hold "=", but a name never holds "/".
    if sep and name and "/" not in name:
        return name, spec
    return None, text


def _pair(text: str, flag: str, names: set[str], model_first: bool = True) -> tuple[str, str]:
    """`NAME=VALUE` (or, not `model_first`, `ALIAS=NAME`) naming a configured model: (the
    model's name, the other side)."""
    left, sep, right = text.partition("=")
    if not sep or not left or not right:
        raise ModelConfigError(f"{flag} {text!r}: expected "
                               f"{'NAME=VALUE' if model_first else 'ALIAS=NAME'}")
    name, other = (left, right) if model_first else (right, left)
    if name not in names:
        raise ModelConfigError(f"{flag} {text!r}: no model named {name!r} (models: "
                               f"{', '.join(sorted(names))})")
    return name, other


def _pairs(values: list[str], flag: str, names: set[str]) -> dict[str, str]:
    """`NAME=VALUE` flags, each naming a configured model once."""
    out: dict[str, str] = {}
    for v in values:
        name, value = _pair(v, flag, names)
        if name in out:
            raise ModelConfigError(f"{flag} {name}= is given twice ({out[name]} and {value})")
        out[name] = value
    return out


def _replicas(value: object, what: str) -> Replicas:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    try:
        if isinstance(value, str):
            return int(value)
    except ValueError:
        pass
    raise ModelConfigError(f"{what}: replicas must be a whole number or \"auto\", "
                           f"got {value!r}")


def _ttl(value: object, what: str) -> float:
    try:
        if not isinstance(value, bool) and isinstance(value, (int, float, str)):
            seconds = float(value)
            if not math.isnan(seconds):  # the model's own check refuses < 0
                return seconds
    except ValueError:
        pass
    raise ModelConfigError(f"{what}: ttl must be a number of seconds, got {value!r}")


def from_flags(models: list[tuple[str, str]], aliases: list[str], pins: list[str],
               ttls: list[str], replicas: list[str]) -> list[ModelConfig]:
    """The models named on the command line, in order (the first is the main model: loaded
    first, and the one the rebalancer balances). `ttls` and `replicas` take NAME=VALUE, or a
    bare VALUE for every model."""
    names = {name for name, _ in models}
    if len(names) != len(models):
        raise ModelConfigError("two --model flags give the same name: pass NAME=PATH")

    def per_model(values: list[str], flag: str) -> tuple[str | None, dict[str, str]]:
        bare = [v for v in values if "=" not in v]
        if len(bare) > 1:
            raise ModelConfigError(f"{flag} for every model is given twice ({bare[0]} and "
                                   f"{bare[1]}): give it once, or NAME=VALUE per model")
        return (bare[0] if bare else None), _pairs([v for v in values if "=" in v], flag, names)

    ttl_all, ttl_of = per_model(ttls, "--ttl")
    rep_all, rep_of = per_model(replicas, "--replicas")
    alias_of: dict[str, list[str]] = {}
    for a in aliases:  # several per model
        target, alias = _pair(a, "--alias", names, model_first=False)
        alias_of.setdefault(target, []).append(alias)
    unknown = [p for p in pins if p not in names]
    if unknown:
        raise ModelConfigError(f"--pin {unknown[0]}: no model named so (models: "
                               f"{', '.join(sorted(names))})")
    out = []
    for name, spec in models:
        ttl, reps = ttl_of.get(name, ttl_all), rep_of.get(name, rep_all)
        out.append(ModelConfig(
            name, spec, tuple(alias_of.get(name, ())), name in pins,
            _ttl(ttl, f"--ttl {name}") if ttl is not None else 0.0,
            _replicas(reps, f"--replicas {name}") if reps is not None else 1))
    check_names(out)
    return out


def from_file(path: Path) -> list[ModelConfig]:
    """The `[[model]]` tables of a TOML file (the module docstring shows the format)."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ModelConfigError(f"cannot read the models config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ModelConfigError(f"the models config {path} is not valid TOML: {e}") from None
    tables = data.get("model")
    if not isinstance(tables, list) or not tables:
        raise ModelConfigError(f"the models config {path} has no [[model]] table")
    known = {"name", "path", "aliases", "pin", "ttl", "replicas", "max_queue", "speculative",
             "parallel", "kind"}
    out = []
    for i, t in enumerate(tables):
        what = f"{path}: model {i + 1}"
        if not isinstance(t, dict):
            raise ModelConfigError(f"{what}: is {t!r}, not a table: write each model as a "
                                   "[[model]] table with name = ..., path = ...")
        extra = sorted(set(t) - known)
        if extra:
            raise ModelConfigError(f"{what}: unknown key {extra[0]!r} (known: "
                                   f"{', '.join(sorted(known))})")
        if "path" not in t:
            raise ModelConfigError(f"{what}: has no path")
        aliases = t.get("aliases", [])
        for key, ok, kind in (("path", isinstance(t["path"], str), "a string"),
                              ("name", isinstance(t.get("name", ""), str), "a string"),
                              ("pin", isinstance(t.get("pin", False), bool), "true or false"),
                              ("speculative", isinstance(t.get("speculative", ""), str),
                               f"a string: {', '.join(MODES)} or draft=PATH"),
                              ("parallel", isinstance(t.get("parallel", ""), str),
                               f"a string: {', '.join(PARALLEL)}"),
                              ("kind", isinstance(t.get("kind", ""), str),
                               f"a string: {', '.join(KINDS)}"),
                              ("aliases", isinstance(aliases, list)
                               and all(isinstance(a, str) for a in aliases),
                               'a list of strings, e.g. aliases = ["gpt-4o-mini"]')):
            if not ok:
                raise ModelConfigError(f"{what}: {key} must be {kind}, got {t[key]!r}")
        name = t.get("name") or Path(t["path"]).name
        out.append(ModelConfig(name, t["path"], tuple(aliases), t.get("pin", False),
                               _ttl(t.get("ttl", 0), what), _replicas(t.get("replicas", 1), what),
                               max_queue=t.get("max_queue"),
                               speculative=t.get("speculative", ""),
                               parallel=t.get("parallel", ""), kind=t.get("kind", "")))
    check_names(out)
    return out


def check_names(models: list[ModelConfig]) -> None:
    """Every name and alias reaches exactly one model."""
    seen: dict[str, str] = {}
    for m in models:
        for n in (m.name, *m.aliases):
            if n in seen:
                raise ModelConfigError(
                    f"the name {n!r} is given to both {seen[n]!r} and {m.name!r}"
                    if seen[n] != m.name else f"model {m.name!r} has the name {n!r} twice")
            seen[n] = m.name


def with_split(models: list[ModelConfig], split: list[int] | None) -> list[ModelConfig]:
    """`--split` is the main model's layer split."""
    return [replace(models[0], split=split), *models[1:]] if split else models
