"""A stage that cannot deliver a request's activations tells the request's head, with the reason, as soon as the
transport gives up (in virtual time, over in-memory links); the head then moves or fails the request."""

from __future__ import annotations

import numpy as np
import trio

from swarmd.inference.undeliverable import ReportUndeliverable
from swarmd.transport.transport import TransportConfig
from swarmd.wire import Error, Forward, Token, WireTensor
from tests.transport.memnet import MemoryNet


class Requests:
    """The one thing the reporter asks of the stage actor: whose request is it."""

    def head_of(self, request_id: str) -> str | None:
        return "head" if request_id == "req-1" else None


def hidden() -> WireTensor:
    return WireTensor.from_array(np.zeros((1, 8), dtype=np.float32))


async def test_an_undeliverable_forward_reaches_the_head_as_an_unreachable_error(autojump_clock):
    async with trio.open_nursery() as nursery:
        net = MemoryNet(nursery)
        config = TransportConfig(send_timeout=5.0)
        errors: list[Error] = []
        heard_at: list[float] = []

        async def on_error(peer: str, msg: Error) -> None:
            errors.append(msg)
            heard_at.append(trio.current_time())

        head = await net.add("head", config)
        head.route(Error, on_error)
        report = ReportUndeliverable()
        stage = await net.add("stage-1", config, on_undeliverable=report)
        report.install(stage, Requests(), "stage-1", nursery)
        net.down.add("stage-2")

        start = trio.current_time()
        await stage.post("stage-2", Forward("req-1", 3, 2, 0, "head", hidden=hidden()))
        await stage.post("stage-2", Forward("req-other", 3, 2, 0, "head", hidden=hidden()))  # not this head's
        await stage.post("head", Token("req-1", 3, 1, 42))  # a token for the head itself: nobody else to tell
        with trio.fail_after(30):
            while not errors:  # noqa: ASYNC110 - polled: the transport's retries run on their own
                await trio.sleep(0.5)
        await trio.sleep(10)
        assert len(errors) == 1 and report.reported == 1
        err = errors[0]
        assert err.code == "unreachable" and err.request_id == "req-1" and (err.step, err.hop) == (3, 2)
        assert "could not deliver forward" in err.message and "connection refused" in err.message  # the transport's reason
        assert heard_at[0] - start < config.send_timeout + 1  # when the transport gave up, not a timeout later
        nursery.cancel_scope.cancel()
