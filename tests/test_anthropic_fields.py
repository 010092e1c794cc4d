"""Every field the installed `anthropic` SDK's request types define is one the Messages adapter
knows (api/anthropic_schema.py), with every value the SDK allows for its literal fields: an SDK
upgrade in CI says which new field a client may send before a user's client gets a 400 for it.

The walk pairs each SDK TypedDict with the schema's model at the same place (by the `type` a
union's member declares) and goes down both. It stops where the schema holds a value opaquely
(a dict, a string) and at the catch-all blocks and tools the adapter itself sorts (OtherBlock,
ServerTool, ContextEdit: `extra="allow"`)."""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin, get_type_hints

import anthropic
import pytest
import typing_extensions
from anthropic.types import message_count_tokens_params, message_create_params
from anthropic.types.beta import message_count_tokens_params as beta_count_tokens_params
from anthropic.types.beta import message_create_params as beta_create_params
from pydantic import BaseModel, ValidationError

from omlx_coordinator.api.anthropic_schema import MessagesRequest, PromptBody

# The SDK sends these as headers (anthropic-beta, anthropic-user-profile-id, ...), not in the body.
HEADER_PARAMS = {"betas", "user_profile_id", "workspace_id"}


def _parts(t: Any) -> list[Any]:
    """The members of a type: Union/Optional/Annotated/Required/Iterable... unwrapped."""
    if isinstance(t, type) and (typing_extensions.is_typeddict(t) or issubclass(t, BaseModel)):
        return [t]
    if get_origin(t) is Literal:
        return [t]
    out = []
    for a in get_args(t):
        if not isinstance(a, (str, int, float, bool)) and a is not None:
            out.extend(_parts(a))
    return out


def _typeddicts(t: Any) -> list[type]:
    return [p for p in _parts(t) if isinstance(p, type) and typing_extensions.is_typeddict(p)]


def _models(t: Any) -> list[type[BaseModel]]:
    return [p for p in _parts(t) if isinstance(p, type) and issubclass(p, BaseModel)]


def _literals(t: Any) -> set | None:
    """The literal values a type allows (inside unions and lists too), or None when it takes
    any string."""
    if t is str:
        return None
    if get_origin(t) is Literal:
        return set(get_args(t))
    values: set = set()
    for a in get_args(t):
        inner = _literals(a)
        if inner is None:
            return None
        values |= inner
    return values


def _fields(model: type[BaseModel]) -> dict[str, Any]:
    return {(f.alias or name): f.annotation for name, f in model.model_fields.items()}


def _match(td: type, models: list[type[BaseModel]]) -> type[BaseModel] | None:
    """The schema's model for the SDK's `td`: the only one, or the one whose `type` takes td's;
    None for a catch-all (the adapter sorts those blocks itself)."""
    if len(models) == 1:
        return models[0]
    sdk_type = _literals(get_type_hints(td).get("type"))
    catch_all = None
    for m in models:
        if m.model_config.get("extra") == "allow":
            catch_all = m
            continue
        ours = _literals(_fields(m).get("type"))
        if sdk_type and ours and sdk_type <= ours:
            return m
    assert catch_all is not None, f"no model of {models} takes {td.__name__} ({sdk_type})"
    return None


def _walk(td: type, model: type[BaseModel], path: str, seen: set, missing: list[str]) -> None:
    if (td, model) in seen or model.model_config.get("extra") == "allow":
        return
    seen.add((td, model))
    ours = _fields(model)
    for key, hint in get_type_hints(td).items():
        at = f"{path}.{key}"
        if path == "" and key in HEADER_PARAMS:
            continue
        if key not in ours:
            missing.append(f"{at} ({td.__name__})")
            continue
        sdk_values, our_values = _literals(hint), _literals(ours[key])
        if sdk_values and our_values is not None and not sdk_values <= our_values:
            missing.append(f"{at}: the values {sorted(map(str, sdk_values - our_values))}")
        sub_models = _models(ours[key])
        for sub in _typeddicts(hint) if sub_models else []:
            m = _match(sub, sub_models)
            if m is not None:
                _walk(sub, m, at, seen, missing)


@pytest.mark.parametrize("params, model", [
    (beta_create_params.MessageCreateParamsBase, MessagesRequest),
    (message_create_params.MessageCreateParamsBase, MessagesRequest),
    (beta_count_tokens_params.MessageCountTokensParams, PromptBody),
    (message_count_tokens_params.MessageCountTokensParams, PromptBody),
], ids=["beta create", "create", "beta count_tokens", "count_tokens"])
def test_every_field_the_sdk_defines_is_known(params: type, model: type[BaseModel]) -> None:
    missing: list[str] = []
    _walk(params, model, "", set(), missing)
    assert not missing, (f"anthropic {anthropic.__version__} defines fields that "
                         f"api/anthropic_schema.py does not know: {missing}")


def test_the_walk_finds_a_field_the_schema_lacks() -> None:
    """The walk itself: a field the SDK has and a model lacks is reported, with its path."""
    class Narrow(BaseModel):
        model: str

    missing: list[str] = []
    _walk(beta_create_params.MessageCreateParamsBase, Narrow, "", set(), missing)
    assert any(m.startswith(".messages ") for m in missing), missing


def test_a_field_no_version_defines_is_refused() -> None:
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(ValidationError, match="frobnicate"):
        MessagesRequest.model_validate({**base, "frobnicate": True})
    tool = {"name": "t", "input_schema": {"type": "object"}, "frobnicate": 1}
    with pytest.raises(ValidationError, match="frobnicate"):
        MessagesRequest.model_validate({**base, "tools": [tool]})
