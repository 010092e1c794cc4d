"""What the request path yields to the API adapters, whatever the protocol: text as it arrives
(Delta), a sign of life while nothing does (KeepAlive), and how the request ended (Done)."""

from __future__ import annotations

from dataclasses import dataclass, field

from proto import omlx_pb2 as pb


@dataclass
class Delta:
    text: str
    tokens: list[int] = field(default_factory=list)  # the tokens that arrived with this text
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # one per token, if asked


@dataclass
class KeepAlive:
    pass


@dataclass
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason "stop")
    # With a prediction (None: none sent): its tokens that stood as drafts, and the rest.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int = 0
