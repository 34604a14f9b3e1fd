"""Shared fixtures: the worker pools (once per session), the tiny runs' corpus and token cache (once per module),
and the hypothesis profiles.

HYPOTHESIS_PROFILE=deep runs many more examples (60 a property) than CI's fixed, derandomized profile (2, and each
property's @example cases).
"""
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
from harness import SNIPPET, Pools, start_fork_server  # noqa: E402

settings.register_profile("ci", max_examples=2, derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("deep", max_examples=60, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session", autouse=True)
def fork_server(request):
    """The pools' fork server, started before the first test (harness.start_fork_server: its imports overlap the tests
    before the first pool) with pytest's output capture on, which its processes inherit: a rank's output goes where a
    test's output goes, not to the terminal. Only where a collected test may fork from it (it asks for `pool`, or its
    file uses harness); otherwise the first Pool starts it, if any does."""
    def uses_harness(item):
        names = vars(getattr(item, "module", None) or sys)  # (an item without a module: not a test file's function)
        return "pool" in getattr(item, "fixturenames", ()) or any(
            v is harness or getattr(v, "__module__", None) == "harness" for v in names.values())
    if any(uses_harness(item) for item in request.session.items):
        start_fork_server()


@pytest.fixture(scope="session")
def pool():
    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 small Python files (harness.SNIPPET): the tiny runs' corpus (harness.tiny)."""
    d = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (d / f"m{i:02d}.py").write_text(SNIPPET.format(i=i))
    return d


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The tiny runs' token cache (--data-cache-dir), one per test module."""
    return tmp_path_factory.mktemp("data_cache")


COLLECTED = pytest.StashKey[set]()  # every node id this session collected (tests/test_repo.py's PROOF check reads it)


@pytest.hookimpl(tryfirst=True)  # (before -k / -m deselect any)
def pytest_collection_modifyitems(session, config, items):
    config.stash[COLLECTED] = {item.nodeid for item in items}


@pytest.fixture(autouse=True)
def signal_handlers_kept(request):
    """A test that leaves a SIGINT or SIGTERM handler behind (an in-process server, a training loop that did not
    restore its own) would change how every later test's process takes a signal (tests/test_signals.py's plain
    KeyboardInterrupt): put the handlers back after each test, and warn with the test's name."""
    import signal
    import warnings
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in before.items():
        if signal.getsignal(s) is not h:
            warnings.warn(f"{request.node.nodeid} left a {s.name} handler behind: {signal.getsignal(s)!r}", stacklevel=1)
            signal.signal(s, h)
