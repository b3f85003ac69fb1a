"""Shared test set-up: offline HF, a private model cache, the built-in model directory."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray rewrites a 127.0.0.1 cluster address to the machine's outward IP unless told this is a
# single-machine setup; the test clusters bind 127.0.0.1 only, so keep the address as given.
# (Read when ray is first imported, hence before anything else.)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray's token authentication, decided explicitly as `hisparse serve` does (read when ray is imported).
os.environ.setdefault("RAY_AUTH_MODE", "token")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Every test session writes the built-in model into its own cache folder."""
    if "HISPARSE_CACHE" not in os.environ:
        os.environ["HISPARSE_CACHE"] = str(tmp_path_factory.mktemp("hisparse-cache"))
    yield


@pytest.fixture(scope="session")
def tiny_dir(_private_cache):
    from model.builtin import ensure_builtin

    return ensure_builtin()


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from model.loader import load_model

    return load_model(tiny_dir)


@pytest.fixture(scope="session", autouse=True)
def _ray_down_at_the_end():
    """The Ray instance the modules share (tests/serving_helpers.py `local_ray`) stops with the session."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def one_torch_thread():
    """One torch thread for a test's duration (modules use it with `pytestmark`): on a busy 2-core machine
    two threads of long CPU work spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
