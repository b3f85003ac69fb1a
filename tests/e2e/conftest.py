"""End-to-end tests need Ray; the gateway helpers live in tests/serving_helpers.py."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
