"""Property-based fuzzing of omnirail's entry points (issue 20).

Every module here fuzzes one entry point: payload encoding and decoding, relay descriptors,
the config loader, the client API. The suite runs each with a fixed seed and
``OMNIRAIL_FUZZ_EXAMPLES`` inputs (10,000 by default) so a failure reproduces exactly; a
longer campaign raises the count and may set ``OMNIRAIL_FUZZ_SEED``:

    OMNIRAIL_FUZZ_EXAMPLES=200000 .venv/bin/python -m pytest tests/fuzz -q

What every property asserts: only the entry point's typed error comes out (never a crash,
a hang, a leak, or a result that depends on what was decoded before).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("OMNIRAIL_FUZZ_EXAMPLES", "10000"))
SEED = os.environ.get("OMNIRAIL_FUZZ_SEED")

settings.register_profile(
    "omnirail-fuzz",
    max_examples=EXAMPLES,
    # Seeded: the same inputs on every run unless OMNIRAIL_FUZZ_SEED asks for others.
    derandomize=SEED is None,
    # Time is bounded per test by pytest-timeout, not per example: a busy 2-core host
    # stalls single examples for reasons that have nothing to do with the input.
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("omnirail-fuzz")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/fuzz/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(pytest.mark.fuzz)
            if SEED is not None:
                from hypothesis import seed

                test = getattr(item, "obj", None)
                if test is not None and hasattr(test, "hypothesis"):
                    seed(int(SEED))(test)
