"""The test harness itself (tests/harness.py): a process forked from the pools' fork server has its imports done
(PRELOAD: else every rank imports torch._dynamo and the test files' libraries itself, and the suite runs slower with
nothing failing), and in_fresh_process reports a failure, a death and a success as they happened."""
import os
import sys

import pytest

import harness


def imported(path: str):
    with open(path, "w") as f:
        f.write(" ".join(m for m in ("fork_server", "torch._dynamo", "transformers", "train") if m in sys.modules))


def raises(x):
    raise ValueError(f"boom {x}")


def dies():
    os._exit(3)


def writes_pid(path: str):
    with open(path, "w") as f:
        f.write(str(os.getpid()))


def test_a_forked_process_has_the_fork_servers_imports(tmp_path):
    harness.in_fresh_process(imported, str(tmp_path / "modules"))
    assert (tmp_path / "modules").read_text().split() == ["fork_server", "torch._dynamo", "transformers", "train"]


def test_in_fresh_process_reports_a_failure_a_death_and_a_success(tmp_path):
    with pytest.raises(harness.CaseFailed, match="ValueError: boom 7"):
        harness.in_fresh_process(raises, 7)
    with pytest.raises(harness.CaseFailed, match=r"died \(exit code 3\)"):
        harness.in_fresh_process(dies)
    harness.in_fresh_process(writes_pid, str(tmp_path / "pid"))
    assert int((tmp_path / "pid").read_text()) != os.getpid()
