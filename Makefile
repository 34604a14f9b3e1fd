# mini-megatron — the two commands a fresh machine needs: `make train MODEL=gpt` and `make test`.
PY      := .venv/bin/python
STAMP   := .venv/.stamp
MODEL   ?= gpt
NPROC   ?= 1
TP      ?= 1
PP      ?= 1
ARGS    ?=

.PHONY: setup test lint train sample bench clean

# A virtualenv with pinned dependencies; idempotent (the stamp records the requirements it was built from).
$(STAMP): requirements.txt requirements-test.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-test.txt
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests/

lint: $(STAMP)
	$(PY) -m ruff check .
