"""The SDK refuses arguments it could only pass on wrong: an empty or non-string address, a
deadline that is not a finite number of seconds above 0 (a negative or nan one would go out
as no deadline at all), a message limit past the pipeline's bound."""

from __future__ import annotations

import math

import pytest

from omnirail.client.sdk import AsyncClient, Client, build_request
from omnirail.wire.errors import Code, OmniError


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"address": ""}, "address must be 'unix:///path' or 'host:port', not ''"),
        ({"address": 5}, "address must be 'unix:///path' or 'host:port', not 5"),
        ({"timeout": -1}, "timeout must be above 0 and finite (None: no deadline), not -1"),
        ({"timeout": 0}, "timeout must be above 0"),
        ({"timeout": math.nan}, "timeout must be above 0"),
        ({"timeout": "5"}, "timeout must be a number of seconds or None, not '5'"),
        ({"max_message_mb": 0}, "max_message_mb must be 1-1024, not 0"),
        ({"max_message_mb": 2.5}, "max_message_mb must be an int, not 2.5"),
    ],
)
@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_bad_client_arguments_are_refused(
    cls: type, kwargs: dict[str, object], problem: str
) -> None:
    args = {"address": "localhost:1", **kwargs}
    address = args.pop("address")
    with pytest.raises(ValueError) as ei:
        cls(address, **args)
    assert str(ei.value) == problem or str(ei.value).startswith(problem), ei.value


@pytest.mark.parametrize("timeout", [-1.0, math.inf, math.nan])
def test_a_request_deadline_that_is_no_deadline_is_invalid(timeout: float) -> None:
    with pytest.raises(OmniError) as ei:
        build_request({"x": 1}, "r", timeout, None)
    assert ei.value.code == Code.INVALID_ARGUMENT and "timeout must be" in ei.value.message


def test_good_deadlines_are_sent() -> None:
    assert build_request({}, "r", None, None).timeout_s == 0.0  # none
    assert build_request({}, "r", 2, None).timeout_s == 2.0
    Client("localhost:1", timeout=0.5, max_message_mb=1024).close()


CALLS = [
    ("generate", ({"n": 1},)),
    ("submit", ({"n": 1},)),
    ("wait", ("r",)),
    ("status", ("r",)),
    ("abort", ("r",)),
    ("describe", ()),
    ("wait_ready", ()),
]


@pytest.mark.parametrize(("method", "args"), CALLS)
def test_a_closed_client_says_so(method: str, args: tuple[object, ...]) -> None:
    """Every call on a closed client is one OmniError (grpc's own is a bare ValueError:
    "Channel closed!")."""
    client = Client("127.0.0.1:1")
    client.close()
    with pytest.raises(OmniError) as err:
        getattr(client, method)(*args)
    assert err.value.code == Code.FAILED_PRECONDITION
    assert "the client is closed" in err.value.message
    with pytest.raises(OmniError, match="the client is closed"):
        list(client.stream({"n": 1}))


@pytest.mark.parametrize(("method", "args"), CALLS[:-1])  # wait_ready: the blocking client's
async def test_a_closed_async_client_says_so(method: str, args: tuple[object, ...]) -> None:
    client = AsyncClient("127.0.0.1:1")
    await client.close()
    with pytest.raises(OmniError) as err:
        await getattr(client, method)(*args)
    assert err.value.code == Code.FAILED_PRECONDITION

    async def consume() -> None:
        async for _ in client.stream({"n": 1}):
            pass

    with pytest.raises(OmniError, match="the client is closed"):
        await consume()
