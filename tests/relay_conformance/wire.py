"""Frames between the conformance sender and its peer: length-prefixed msgpack maps."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

_LEN = struct.Struct("<I")
# Frames carry descriptors, echoes of small values and error texts: never tensor bytes of
# the large sizes, so a bound catches a desynchronised stream instead of allocating GiBs.
MAX_FRAME = 64 << 20


def encode(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


async def read(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The next frame; IncompleteReadError at EOF."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes: stream out of sync")
    msg = msgpack.unpackb(await reader.readexactly(n), raw=False, strict_map_key=False)
    if not isinstance(msg, dict):
        raise ValueError(f"frame is not a map: {type(msg).__name__}")
    return msg
