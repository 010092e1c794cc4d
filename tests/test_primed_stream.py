"""A streamed reply's generation starts before its response does (common.Primed), and ends
however the response ends (common.ClosingStream): a client gone before the headers must not
leave its generation running on the node."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from omlx_coordinator.api.common import ClosingStream, Primed


class Generation:
    """An async generator that says when it started and whether it was unwound."""

    def __init__(self, fail: bool = False):
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.unwound = False
        self.fail = fail

    async def run(self):
        self.started.set()
        try:
            await self.release.wait()  # the node computing the first token
            if self.fail:
                raise RuntimeError("the node refused it")
            yield "first"
            yield "second"
        finally:
            self.unwound = True


def test_the_first_step_runs_before_anyone_iterates() -> None:
    async def main() -> list[str]:
        g = Generation()
        primed = Primed(g.run())
        await asyncio.wait_for(g.started.wait(), 2)  # nobody has asked for an event yet
        g.release.set()
        return [ev async for ev in primed]

    assert asyncio.run(main()) == ["first", "second"]


def test_a_failed_first_step_raises_where_it_is_read() -> None:
    async def main() -> None:
        g = Generation(fail=True)
        primed = Primed(g.run())
        g.release.set()
        await asyncio.sleep(0.01)
        async for _ in primed:
            pass

    with pytest.raises(RuntimeError, match="refused"):
        asyncio.run(main())


def test_closing_it_mid_step_unwinds_the_generation() -> None:
    async def main() -> Generation:
        g = Generation()
        primed = Primed(g.run())
        await g.started.wait()
        await primed.aclose()
        return g

    assert asyncio.run(main()).unwound


def test_a_client_gone_before_the_headers_ends_its_generation() -> None:
    async def main() -> bool:
        g = Generation()
        events = Primed(g.run())

        async def body():
            async for ev in events:
                yield ev

        async def receive() -> dict:
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            raise OSError("the client hung up")

        await g.started.wait()
        with pytest.raises(ClientDisconnect):
            stream = ClosingStream(body(), events, limit=60.0)
            await stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        # Its body never started: only the response could close it (asyncio.run's own
        # clean-up at the end would hide a generation left running, so look now).
        return g.unwound

    assert asyncio.run(main())
