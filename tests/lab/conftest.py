"""Lab fixtures: one app on the fake runner for the whole session (each test resets the
scenario it plays, so they share it; building the app once keeps the chapter tests fast)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from support.fake_lab import fake_lab_engine

from minivllm.lab.app import create_app


@pytest.fixture(scope="session")
def lab_client() -> TestClient:
    return TestClient(create_app(fake_lab_engine))
