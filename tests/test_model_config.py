"""Which models a cluster serves, from flags and from a TOML file, and what it refuses; and the
pure choice of what a node under memory pressure sheds."""

from __future__ import annotations

from pathlib import Path

import pytest

from omlx_coordinator.models import model_config as mc
from omlx_coordinator.models.placement import LoadedModel, pressure_victim


def test_flags_name_alias_pin_ttl_and_replicas():
    models = mc.from_flags([("general", "/m/big"), ("coder", "/m/coder"), ("small", "/m/s")],
                           aliases=["gpt-4o-mini=coder", "cc=coder"], pins=["coder"],
                           ttls=["600", "small=30"], replicas=["coder=auto"])
    by = {m.name: m for m in models}
    assert [m.name for m in models] == ["general", "coder", "small"]  # the main model first
    assert by["coder"].aliases == ("gpt-4o-mini", "cc") and by["coder"].pinned
    assert (by["general"].ttl_seconds, by["small"].ttl_seconds) == (600.0, 30.0)
    assert (by["coder"].replicas, by["general"].replicas) == ("auto", 1)


@pytest.mark.parametrize("arg, expected", [
    ("coder=/models/x", ("coder", "/models/x")),
    ("/models/x", (None, "/models/x")),
    ("/models/a=b", (None, "/models/a=b")),  # a name never holds "/"
    ("SmolLM2", (None, "SmolLM2")),
])
def test_model_arg(arg, expected):
    assert mc.parse_model_arg(arg) == expected


@pytest.mark.parametrize("kwargs, message", [
    ({"models": [("a", "/x"), ("a", "/y")]}, "two --model flags give the same name"),
    ({"pins": ["b"]}, "--pin b: no model named so (models: a)"),
    ({"ttls": ["a=soon"]}, "--ttl a: ttl must be a number of seconds, got 'soon'"),
    ({"ttls": ["b=3"]}, "--ttl 'b=3': no model named 'b'"),
    ({"ttls": ["60", "300"]}, "--ttl for every model is given twice (60 and 300)"),
    ({"ttls": ["a=60", "a=300"]}, "--ttl a= is given twice (60 and 300)"),
    ({"replicas": ["a=0"]}, "model a: replicas must be a positive integer"),
    ({"replicas": ["many"]}, "replicas must be a whole number or \"auto\", got 'many'"),
    ({"aliases": ["z=b"]}, "--alias 'z=b': no model named 'b' (models: a)"),
    ({"aliases": ["a=a"]}, "model 'a' has the name 'a' twice"),
    ({"aliases": ["x"]}, "--alias 'x': expected ALIAS=NAME"),
    ({"models": [("a", "/x"), ("b", "/y")], "aliases": ["b=a"]},
     "the name 'b' is given to both 'a' and 'b'"),
])
def test_bad_flags_say_what_is_wrong(kwargs, message):
    args = {"models": [("a", "/x")], "aliases": [], "pins": [], "ttls": [], "replicas": []}
    with pytest.raises(mc.ModelConfigError) as e:
        mc.from_flags(**{**args, **kwargs})
    assert message in str(e.value)


def test_config_file(tmp_path: Path):
    f = tmp_path / "models.toml"
    f.write_text('[[model]]\nname = "coder"\npath = "/m/coder"\naliases = ["gpt-4o"]\n'
                 'pin = true\nttl = 1800\nreplicas = "auto"\nspeculative = "off"\n\n'
                 '[[model]]\npath = "/m/small"\n')
    coder, small = mc.from_file(f)
    assert (coder.name, coder.aliases, coder.pinned, coder.ttl_seconds, coder.replicas,
            coder.speculative) == ("coder", ("gpt-4o",), True, 1800.0, "auto", "off")
    assert (small.name, small.spec, small.replicas, small.speculative) == (
        "small", "/m/small", 1, "")


@pytest.mark.parametrize("text, message", [
    ("", "has no [[model]] table"),
    ('[[model]]\nname = "x"\n', "model 1: has no path"),
    ('[[model]]\npath = "/a"\nsize = 3\n', "unknown key 'size'"),
    ("[[model]\n", "is not valid TOML"),
    ('[[model]]\npath = "/a"\nttl = -1\n', "ttl must be >= 0"),
    # Values of the wrong TOML type are named, never read some other way or a traceback.
    ('[[model]]\npath = "/a"\naliases = "gpt-4o-mini"\n', "aliases must be a list of strings"),
    ('[[model]]\npath = "/a"\nreplicas = 2.7\n', "replicas must be a whole number"),
    ('[[model]]\npath = "/a"\nreplicas = true\n', "replicas must be a whole number"),
    ('[[model]]\npath = "/a"\nttl = [1]\n', "ttl must be a number of seconds, got [1]"),
    ('[[model]]\npath = "/a"\npin = "yes"\n', "pin must be true or false"),
    ('[[model]]\npath = 5\n', "path must be a string"),
    ('[[model]]\npath = "/a"\nspeculative = "draft"\n',
     "unknown speculative mode 'draft': use one of off, ngram, auto, or draft=PATH"),
    ('[[model]]\npath = "/a"\nspeculative = "mtp"\n', "mlx-lm 0.32 loads no model family's"),
    ('[[model]]\npath = "/a"\nspeculative = true\n', "speculative must be a string"),
    ("model = [1]\n", "model 1: is 1, not a table"),
])
def test_bad_config_files(tmp_path: Path, text, message):
    f = tmp_path / "models.toml"
    f.write_text(text)
    with pytest.raises(mc.ModelConfigError) as e:
        mc.from_file(f)
    assert message in str(e.value)
    with pytest.raises(mc.ModelConfigError, match="cannot read the models config"):
        mc.from_file(tmp_path / "missing.toml")


def test_pressure_sheds_the_least_recently_used_idle_model_there():
    loaded = [LoadedModel("busy", {"mac-a": 5}, last_used=1.0, in_flight=2),
              LoadedModel("pinned", {"mac-a": 5}, last_used=2.0, pinned=True),
              LoadedModel("old", {"mac-a": 5}, last_used=3.0),
              LoadedModel("newer", {"mac-a": 5, "mac-b": 5}, last_used=4.0),
              LoadedModel("elsewhere", {"mac-b": 5}, last_used=0.5)]
    assert pressure_victim(loaded, "mac-a") == "old"
    assert pressure_victim(loaded, "mac-b") == "elsewhere"
    assert pressure_victim(loaded[:2], "mac-a") is None  # busy and pinned never go
