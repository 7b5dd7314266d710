"""Joining a running mesh as a member, for tests that Deliver to a stage by hand.

Deliver streams are authenticated per member (omnirail/transport/members.py): a test
that sends items to a stage itself first registers, through Attach, as a draining replica
of the stage its items claim to come from (so the coordinator routes nothing to it), and
shows the member token it got.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omnirail.stage_service.attach import AttachClient
from omnirail.transport.members import MemberCredentials
from omnirail.v1 import mesh_pb2


@contextmanager
def member_of(coordinator: str, stage: str, security: Any = None) -> Iterator[MemberCredentials]:
    """Credentials of a draining replica of `stage`, attached until the block ends."""
    replica_id = f"test-member-{uuid.uuid4().hex[:8]}"
    ready = threading.Event()
    got: dict[str, Any] = {}
    loop = asyncio.new_event_loop()

    def on_command(cmd: mesh_pb2.CoordinatorCommand) -> None:
        if cmd.member_token:
            got["token"] = cmd.member_token
            ready.set()

    attach: AttachClient | None = None

    async def run() -> None:
        nonlocal attach
        attach = AttachClient(
            coordinator,
            mesh_pb2.Register(
                stage=stage, replica_id=replica_id, address="127.0.0.1:9", pid=os.getpid()
            ),
            on_command,
            security=security,
        )
        attach.drain()  # registers draining: nothing is routed to it
        await attach.run()

    thread = threading.Thread(target=lambda: loop.run_until_complete(run()), daemon=True)
    thread.start()
    try:
        if not ready.wait(60):
            raise TimeoutError(f"could not join the mesh at {coordinator} as a member")
        yield MemberCredentials(replica_id, stage, got["token"])
    finally:
        if attach is not None:
            loop.call_soon_threadsafe(attach.stop)
        thread.join(10)
        loop.close()
