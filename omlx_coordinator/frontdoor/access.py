"""Who sends a request and what it may do: the key it presented (keys.py), checked against the
route's role, the model's allow-list and the key's quotas, and the usage it is counted under
(usage.py). The gateway identifies the key before a route reads the body and leaves an
Account in the request's ASGI scope; the routes admit a generation through `admit`."""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass

from fastapi import Request

from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.keys import Key, KeyRing
from omlx_coordinator.frontdoor.usage import ANONYMOUS, Usage
from omlx_coordinator.models.admission import hold
from omlx_coordinator.models.priority import INTERACTIVE
from omlx_coordinator.models.served_model import ServedModel

_SCOPE_KEY = "omlx.account"
RATE_LIMITED = "rate_limit_exceeded"


@dataclass
class Account:
    """A request's key (None on a gateway without keys) and the ledger it is counted in."""

    key: Key | None
    usage: Usage

    @property
    def name(self) -> str:
        return self.key.name if self.key is not None else ANONYMOUS

    @property
    def priority(self) -> str:
        return self.key.priority if self.key is not None else INTERACTIVE

    @property
    def admin(self) -> bool:
        return self.key is None or self.key.admin

    def finished(self, model: str, prompt: int, cached: int, completion: int,
                 failed: bool) -> None:
        self.usage.finished(self.name, model, prompt, cached, completion, failed)


def presented_keys(request: Request) -> list[str]:
    """What the client sent as its key: Bearer (OpenAI's SDKs) or x-api-key (Anthropic's)."""
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    keys = [request.headers.get("x-api-key", "").strip()]
    if scheme.lower() == "bearer":
        keys.append(bearer.strip())
    return [k for k in keys if k]


def identify(request: Request, ring: KeyRing, usage: Usage) -> Account | None:
    """The request's account, kept in its scope; None when the gateway has keys and it sent
    none of them."""
    if ring.open:
        account = Account(None, usage)
    else:
        key = next((k for k in map(ring.identify, presented_keys(request)) if k), None)
        if key is None:
            return None
        account = Account(key, usage)
    request.scope[_SCOPE_KEY] = account
    return account


def account_of(scope: MutableMapping) -> Account | None:
    return scope.get(_SCOPE_KEY)


def usable(scope: MutableMapping, models: list[ServedModel]) -> list[ServedModel]:
    """The models the request's key may use (every one without keys or a models list)."""
    account = account_of(scope)
    key = account.key if account is not None else None
    return [m for m in models if key is None or key.may_use(m.names)]


def require_admin(request: Request) -> None:
    """403 for a user key on an admin route (the key itself was checked before)."""
    account = account_of(request.scope)
    if account is not None and not account.admin:
        raise APIError(403, f"this needs an admin key: the key {account.name!r} has the role "
                            "'user', which may generate and read its own usage only",
                       type="permission_error", code="admin_required")


def check(account: Account | None, model: ServedModel) -> None:
    """Whether the account may send a request for `model` now: a 403 if its key may not use
    the model, a 429 (rate_limit_exceeded, with Retry-After) over the key's quota."""
    key = account.key if account is not None else None
    if key is None:
        return
    if not key.may_use(model.names):
        raise APIError(403, f"the key {key.name!r} may not use the model {model.name!r}; it "
                            f"may use: {', '.join(sorted(key.models or ()))}", param="model",
                       type="permission_error", code="model_not_allowed")
    if (over := account.usage.check(key)) is not None:
        raise APIError(429, over.message, type="requests", code=RATE_LIMITED,
                       headers={"Retry-After": str(over.retry_after)})


def admit(scope: MutableMapping, model: ServedModel, n: int = 1) -> None:
    """Admits a generation request for `model` (checked by `check`) holding `n` places of its
    queue: a 429 past the model's queue bound (admission.py); counts it in its key's usage."""
    hold(scope, model.admission, n)
    if (account := account_of(scope)) is not None:
        account.usage.admitted(account.name, model.name)
