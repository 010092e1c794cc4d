"""The one error type of the request path: what went wrong, its HTTP status and the field.

Raised by the generation core and the protocol adapters alike; each protocol renders it in its
own shape (OpenAI's error object here, Anthropic's in api/anthropic.py).
"""

from __future__ import annotations


class APIError(Exception):
    """An error the client caused or must know about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers  # sent with it (a refusal's Retry-After)

    def body(self) -> dict:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
