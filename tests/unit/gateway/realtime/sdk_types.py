"""Server events checked against the official `openai` SDK's own pydantic types.

The SDK's client builds events with `construct` (no validation), so a wrong field would
pass unnoticed there; here each event is validated by the type the SDK picks for its
`type`, and any field that type does not know (pydantic's extras, at any depth) fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

import pydantic
from openai.types.realtime.realtime_server_event import RealtimeServerEvent


def _server_types() -> dict[str, type[pydantic.BaseModel]]:
    union = get_args(RealtimeServerEvent)[0]  # Annotated[Union[...], discriminator]
    types: dict[str, type[pydantic.BaseModel]] = {}
    for member in get_args(union):
        (name,) = get_args(member.model_fields["type"].annotation)
        types[name] = member
    return types


SERVER_TYPES = _server_types()


def parse_server_event(event: dict[str, Any]) -> pydantic.BaseModel:
    """`event` validated by the SDK's type for it; fails on a field the type lacks."""
    kind = event["type"]
    assert kind in SERVER_TYPES, f"the SDK has no server event {kind!r}"
    model = SERVER_TYPES[kind].model_validate(event)
    unknown = list(_extras(model, kind))
    assert not unknown, f"fields the SDK's types do not have: {unknown}"
    return model


def _extras(value: Any, path: str) -> Iterator[str]:
    if isinstance(value, pydantic.BaseModel):
        for key in value.model_extra or {}:
            yield f"{path}.{key}"
        for name in type(value).model_fields:
            yield from _extras(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for index, entry in enumerate(value):
            yield from _extras(entry, f"{path}[{index}]")
    elif isinstance(value, dict):
        for key, entry in value.items():
            yield from _extras(entry, f"{path}.{key}")
