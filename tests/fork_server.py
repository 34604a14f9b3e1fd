"""What the test pools' fork server imports once for every process it forks (harness.PRELOAD names this module):
torch and train.py; torch._dynamo, which torch.optim's first optimizer imports (~1.2 s a process); and what the
test files' cases import in their ranks (a rank imports its test file), Megatron-core quietly (its import warns and
logs, which the fork server would print after pytest's summary). Each one a rank would otherwise import itself:
py-spy found a third of the ranks' CPU time in imports."""
import contextlib
import io
import warnings

import fastapi  # noqa: F401
import hypothesis  # noqa: F401
import matplotlib.figure  # noqa: F401
import openai  # noqa: F401
import pytest  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import transformers  # noqa: F401

import train  # noqa: F401

with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
    warnings.simplefilter("ignore")
    with contextlib.suppress(ImportError):  # (an optional test dependency: its tests skip without it)
        import megatron.core  # noqa: F401
