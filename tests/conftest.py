"""Shared fixtures: a tiny Qwen2 model built on the fly, and a LocalBackend on it."""

from __future__ import annotations

import pytest
import torch

from sgl_tts.models import build_tiny_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def backend(tiny_model_path):
    from sgl_tts import LocalBackend

    be = LocalBackend(tiny_model_path, seed=0)
    yield be
    be.shutdown()


@pytest.fixture(scope="session")
def hf_model(backend):
    """The backend's own transformers model, for direct reference forwards."""
    return backend.model
