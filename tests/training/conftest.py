"""Shared fixtures of the trainer tests: low torch thread counts, one tiny-model cache per session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import torch
except ImportError:  # no torch here: the modules that need it are skipped (tests/conftest.py)
    pass
else:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The FLEET_TRAINING_CACHE of the trainer tests: the session's (tests/conftest.py), else this
    worker's own (the tiny model, corpus, converted SmolLM2 and regenerated sets built once)."""
    folder = Path(os.environ.get("FLEET_TEST_TRAINING_CACHE") or tmp_path_factory.mktemp("training-cache"))
    previous = os.environ.get("FLEET_TRAINING_CACHE")
    os.environ["FLEET_TRAINING_CACHE"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("FLEET_TRAINING_CACHE", None)
    else:
        os.environ["FLEET_TRAINING_CACHE"] = previous
