"""Shared fixtures: the worker pool (once per session) and the hypothesis profiles.

HYPOTHESIS_PROFILE=deep runs many more examples (60 a property) than CI's fixed, derandomized profile (3).
"""
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import Pools  # noqa: E402

settings.register_profile("ci", max_examples=3, derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("deep", max_examples=60, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def pool():
    p = Pools()
    yield p
    p.close()
