"""When a request that lost its attempt runs again: the rules, as a function of how each
attempt ended, with no I/O, so that each is tested in milliseconds (tests/test_request_path.py).

How an attempt ends says whose failure it was. A chunk ending "aborted" is a worker that stopped
cleanly (a new plan): run again, always. A call that breaks (the worker went down, or its
pipeline lost a stage: UNAVAILABLE and the like) may be a lost node or a request that brings the
node down; the first is run again on the next plan, and a request whose attempt breaks a second
plan, loaded after its first break, is refused with its own error: a "query of death" must not
take down plan after plan, and every request beside it each time. Every other ending (an
"error" chunk: the request's own sampler or grammar; any other status) is the request's answer,
never run again. However it loses them, a request runs at most MAX_ATTEMPTS attempts.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from omlx_coordinator.errors import APIError
from omlx_coordinator.models.deployment import Deployment
from proto import omlx_pb2 as pb

# A call that failed this way lost its node, not its request: run it again on the next plan.
RETRIABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}
MAX_ATTEMPTS = 5

# One plan of one replica: the replica and the epoch it was at.
PlanRef = tuple[Deployment, int]


@dataclass(frozen=True)
class Lost:
    """How an attempt was lost."""

    why: str
    broke: bool  # the node failed under the attempt (False: its worker stopped cleanly)


def lost_by(item: pb.TokenChunk | grpc.aio.AioRpcError) -> Lost | None:
    """How `item`, the last thing an attempt received, lost it; None when it did not (a chunk
    the request goes on with, or an ending that is the request's own)."""
    if isinstance(item, grpc.aio.AioRpcError):
        return (Lost(f"{item.code().name}: {item.details()}", True)
                if item.code() in RETRIABLE else None)
    if item.finish_reason == "aborted":
        return Lost(item.error or "the worker shut down", False)
    return None


@dataclass(frozen=True)
class Resume:
    """Run the request again, not on `avoid` (the plan it just lost) while another can take it."""

    avoid: PlanRef


@dataclass(frozen=True)
class Fail:
    """Give up: `error` is the client's answer, `log` the line that says why in the log."""

    error: APIError
    log: str


@dataclass
class RetryState:
    """What one request's lost attempts so far decide about the next."""

    losses: int = 0  # attempts lost
    avoid: PlanRef | None = None  # the plan the last one was lost on
    broke: PlanRef | None = None  # the plan an attempt first broke

    def on_lost(self, plan: PlanRef, lost: Lost) -> Resume | Fail:
        """The attempt on `plan` was lost so: whether and where the request goes on."""
        self.losses += 1
        self.avoid = plan
        if lost.broke and self.broke is not None and (plan[0] is not self.broke[0]
                                                      or plan[1] > self.broke[1]):
            return Fail(APIError(500, "the node went down under this request on two plans, so "
                                      "it is not run again; last: " + lost.why,
                                 type="server_error", code="request_failed_node"),
                        f"a request broke plan {plan[1]} of {plan[0].name} after plan "
                        f"{self.broke[1]} of {self.broke[0].name}; it is not run again: "
                        f"{lost.why}")
        if lost.broke and self.broke is None:
            self.broke = plan
        if self.losses >= MAX_ATTEMPTS:
            return Fail(APIError(503, f"lost the node {self.losses} times; last: {lost.why}",
                                 type="server_error"),
                        f"a request lost its node {self.losses} times; it is not run again: "
                        f"{lost.why}")
        return Resume(plan)
