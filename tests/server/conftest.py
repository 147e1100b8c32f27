"""Fixtures shared by the engine server's tests."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import EngineServer


@pytest.fixture(scope="module")
def client(tiny_server: EngineServer) -> Iterator[openai.OpenAI]:
    """The official client against the session's tiny engine server."""
    with openai.OpenAI(
        base_url=tiny_server.base_url + "/v1", api_key="none", max_retries=0
    ) as client:
        yield client
