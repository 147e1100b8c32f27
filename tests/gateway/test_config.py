"""The deployment config: tenants' cache groups."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from infercloud.gateway.config import DeploymentConfig

MODELS = [{"name": "m", "replicas": [{"upstream": {"url": "http://127.0.0.1:9/v1"}}]}]


def test_a_tenant_in_a_cache_group_uses_the_groups_namespace_others_their_own() -> None:
    config = DeploymentConfig.model_validate(
        {
            "models": MODELS,
            "tenants": {"a": {"cache_group": "g"}, "b": {"cache_group": "g"}, "c": {"rpm": 5}},
        }
    )
    assert config.cache_namespace("a") == config.cache_namespace("b") == "group:g"
    assert config.cache_namespace("c") == "c"
    assert config.cache_namespace("unlisted") == "unlisted"


@pytest.mark.parametrize("group", ["", "a:b", "a/b", "x" * 129])
def test_a_cache_group_name_that_could_collide_with_a_namespace_is_refused(group: str) -> None:
    with pytest.raises(ValidationError):
        DeploymentConfig.model_validate(
            {"models": MODELS, "tenants": {"a": {"cache_group": group}}}
        )
