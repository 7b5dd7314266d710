"""DeliverChannel bookkeeping when releasing a credit immediately sends the next chunk."""

from __future__ import annotations

import asyncio

from omnirail.transport.deliver import DeliverChannel
from omnirail.v1 import mesh_pb2


class _Credit:
    """A stream credit whose release hands the edge's slot to a waiting chunk (send())."""

    acked_in_band = True

    def __init__(self, channel: DeliverChannel, rid: str, then_send: bool) -> None:
        self.channel, self.rid, self.then_send, self.released = channel, rid, then_send, 0

    def release(self) -> None:
        self.released += 1
        if self.then_send:
            self.channel.send(
                mesh_pb2.DeliverItem(request_id=f"next-{self.rid}"),
                _Credit(self.channel, f"next-{self.rid}", False),
            )


async def test_a_broken_stream_releases_every_credit_even_when_releases_send_more() -> None:
    lost: list[tuple[list[str], str]] = []
    channel = DeliverChannel("127.0.0.1:1", "me", lambda rids, why: lost.append((rids, why)))
    credits = [_Credit(channel, f"r{i}", then_send=True) for i in range(20)]
    for c in credits:
        channel.send(mesh_pb2.DeliverItem(request_id=c.rid), c)
    # Nothing listens at port 1: the stream breaks, every held credit must come back once,
    # and the chunks those releases let through are queued for the next attempt.
    for _ in range(200):
        if all(c.released for c in credits):
            break
        await asyncio.sleep(0.01)
    assert [c.released for c in credits] == [1] * 20
    assert sorted(lost[0][0]) == sorted(c.rid for c in credits)
    assert channel._task is not None and not channel._task.done()  # still serving
    await channel.close()


async def test_forget_request_releases_after_dropping() -> None:
    channel = DeliverChannel("127.0.0.1:1", "me", lambda rids, why: None)
    channel._closed = False
    credit = _Credit(channel, "gone", then_send=True)
    channel._seq = 0
    # Queue without starting the task, as if the stream were busy.
    channel._task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    channel.send(mesh_pb2.DeliverItem(request_id="gone"), credit)
    channel.forget_request("gone")
    assert credit.released == 1
    assert [i.request_id for i in channel._queue] == ["next-gone"]
    channel._task.cancel()
    await channel.close()
