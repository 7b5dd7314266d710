"""The error every config check raises."""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(ValueError):
    """An invalid pipeline config; `errors` holds every problem found, one per entry."""

    def __init__(self, errors: str | Iterable[str], source: str | None = None) -> None:
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        self.source = source
        super().__init__("\n".join(self.errors))

    def __str__(self) -> str:
        return "\n".join(self.errors)
