"""`security.quotas`: per-principal limits and weights, refused with the field named."""

from __future__ import annotations

import pytest

from omnirail.config import PipelineConfig
from omnirail.config.security import Quota, QuotasConfig
from tests.unit.config.helpers import config_error, pipe, st


def _with(quotas: object) -> dict[str, object]:
    return pipe(st("a", terminal=True), security={"quotas": quotas})


def test_a_valid_quotas_section_loads_and_gives_each_principal_its_quota() -> None:
    cfg = PipelineConfig.from_dict(
        _with(
            {
                "default": {"weight": 1, "max_live_requests": 8},
                "principals": {"web": {"weight": 4, "requests_per_s": 2.5, "burst": 5}},
            }
        )
    )
    quotas = cfg.security.quotas
    assert quotas is not None
    assert quotas.of("web") == Quota(weight=4, requests_per_s=2.5, burst=5)
    assert quotas.of("someone-else").max_live_requests == 8


@pytest.mark.parametrize(
    ("quotas", "where", "why"),
    [
        ({"default": {"weight": -1}}, "security.quotas.default.weight", "greater than or equal"),
        (
            {"principals": {"web": {"max_live_requests": -3}}},
            "security.quotas.principals.web.max_live_requests",
            "greater than or equal to 1",
        ),
        (
            {"principals": {"web": {"requests_per_s": 0}}},
            "security.quotas.principals.web.requests_per_s",
            "greater than 0",
        ),
        (
            {"principals": {"web": {"requests_per_s": float("nan")}}},
            "security.quotas.principals.web.requests_per_s",
            "finite",
        ),
        (
            {"principals": {"web": {"burst": 4}}},
            "security.quotas.principals.web",
            "burst: needs requests_per_s",
        ),
        (
            {"default": {"weight": 0}, "principals": {"a": {"weight": 0}, "b": {"weight": 0}}},
            "security.quotas",
            "sum to zero",
        ),
        ({"default": {"weight": 0}}, "security.quotas", "sum to zero"),
        (
            {"principals": {"has space": {}}},
            "security.quotas.principals",
            "a principal is 1-64 characters",
        ),
        ({"principals": {"web": {"wieght": 2}}}, "security.quotas.principals.web.wieght", ""),
        ({"defaults": {}}, "security.quotas.defaults", ""),
    ],
)
def test_bad_quota_settings_fail_naming_the_field(quotas: object, where: str, why: str) -> None:
    message = str(config_error(_with(quotas)))
    assert where in message, message
    assert why in message, message


def test_weights_of_zero_are_allowed_while_some_weight_is_not() -> None:
    quotas = QuotasConfig.model_validate({"default": {"weight": 0}, "principals": {"a": {}}})
    assert quotas.of("a").weight == 1 and quotas.of("b").weight == 0
