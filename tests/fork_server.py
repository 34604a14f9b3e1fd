"""What the test pools' fork server imports once for every process it forks (harness.PRELOAD names this module):
torch and train.py; torch._dynamo, which torch.optim's first optimizer imports (~1.2 s a process); and what the
test files' cases import in their ranks (a rank imports its test file), Megatron-core quietly (its import warns and
logs, which the fork server would print after pytest's summary). Each one a rank would otherwise import itself:
py-spy found a third of the ranks' CPU time in imports. torch first, as a rank imports it (the order matters: with
numpy's first, through matplotlib, the forked ranks ran test_data_parallel.py at half the speed)."""
# ruff: noqa: I001, F401
import torch
import torch._dynamo
import torch.distributed
import torch.distributed.checkpoint
import torch.distributed.fsdp

import train

import contextlib
import io
import warnings

import fastapi
import hypothesis
import matplotlib.figure
import openai
import pytest
import transformers

with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
    warnings.simplefilter("ignore")
    with contextlib.suppress(ImportError):  # (an optional test dependency: its tests skip without it)
        import megatron.core
