# mini-megatron — the two commands a fresh machine needs: `make train MODEL=gpt` and `make test`. More:
#   make train MODEL=gpt NPROC=2 TP=2 ARGS="--train-iters 100"    # -> runs/gpt/ (torchrun when NPROC > 1; also PP=)
#   make train ARGS="--task dpo --pretrained-checkpoint runs/gpt"   # -> runs/gpt-dpo/ (--task sft, dpo, kto or rm)
#   make sample PROMPT="class "                                     # text from runs/$(MODEL) (RUN=... for another)
#   make serve                                                      # runs/$(MODEL) behind an OpenAI-compatible API
#   make eval RUN=runs/gpt ARGS="--limit 10"                        # lm-eval on the shipped tasks, through the server
#   make lint
#   make bench
#   make soak ARGS="--minutes 3"
PYTHON  ?= python3
PY      := .venv/bin/python
STAMP   := .venv/.stamp
MODEL   ?= gpt
NPROC   ?= 1
TP      ?= 1
PP      ?= 1
ARGS    ?=
MINUTES ?= 8
# A post-training task (--task X in ARGS, or task: X in its --config file) runs in runs/$(MODEL)-X: it never resumes
# or overwrites the pretraining run (which it may start from: --pretrained-checkpoint runs/$(MODEL))
CONFIG  := $(shell printf '%s\n' '$(ARGS)' | sed -n 's/.*--config[ =]*\([^ ]*\).*/\1/p')
TASK    := $(filter-out pretrain,$(or $(shell printf '%s\n' '$(ARGS)' | sed -n 's/.*--task[ =]*\([a-z]*\).*/\1/p'),\
                                      $(if $(CONFIG),$(shell sed -n 's/^task: *\([a-z]*\).*/\1/p' $(CONFIG) 2>/dev/null))))
RUN     ?= runs/$(MODEL)$(if $(TASK),-$(TASK))
# torch is pinned (2.13.0) in requirements.txt and comes from the package index pip is configured with. On a CPU-only
# machine that has no local CPU wheel, PyPI's Linux torch pulls several GB of CUDA libraries: point TORCH_INDEX at
# PyTorch's CPU wheel index to avoid that (opt-in; off by default so setup only ever talks to the configured index).
TORCH_INDEX ?=
LAUNCH  := $(if $(filter 1,$(NPROC)),$(PY),OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC))

.PHONY: setup test lint train sample serve eval bench soak clean

# A virtualenv with pinned dependencies; idempotent (the stamp is newer than the requirements it was built from).
$(STAMP): requirements.txt requirements-test.txt
	$(PYTHON) -m venv .venv
	$(PY) -m pip install -q -r requirements-test.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	touch $(STAMP)

setup: $(STAMP)

# EvalScope in a virtualenv of its own (requirements-evalscope.txt says why); idempotent like .venv. make test needs it
# (tests/test_eval.py runs evalscope against the server); make eval only with ARGS="--harness evalscope".
ES_STAMP := .venv-evalscope/.stamp
$(ES_STAMP): requirements-evalscope.txt
	$(PYTHON) -m venv .venv-evalscope
	.venv-evalscope/bin/python -m pip install -q -r requirements-evalscope.txt
	touch $(ES_STAMP)

test: $(STAMP) $(ES_STAMP)
	$(PY) -m pytest -q tests/

lint: $(STAMP)
	$(PY) -m ruff check .

# The default run (train.py's defaults): a 4-layer llama-style GPT on the Python stdlib sources. Given no --train-iters,
# its learning-rate schedule (WSD) is fitted to $(MINUTES) minutes and completes on a slow machine too; the time guard
# still stops (and saves) so the command always ends within ~$(MINUTES)+1 minutes.
# NPROC > 1: the flags, data and checkpoints are checked in one process first (train.py --check-only), so a mistake
# is one line before torchrun starts any rank.
TRAIN   := train.py --model $(MODEL) --tensor-model-parallel-size $(TP) --pipeline-model-parallel-size $(PP) \
           --load $(RUN) --save $(RUN) --exit-duration-in-mins $(MINUTES) $(ARGS)
train: $(STAMP)
	@$(if $(filter 1,$(NPROC)),:,WORLD_SIZE=$(NPROC) $(PY) $(TRAIN) --check-only)
	$(LAUNCH) $(TRAIN)

SAMPLE_ONE = make sample runs one process on a run saved at any layout: leave out NPROC=$(NPROC) TP=$(TP) (make serve \
             NPROC=2 TP=2 serves at TP 2)
sample: $(STAMP)
	$(if $(filter-out 1,$(NPROC) $(TP)),$(error $(SAMPLE_ONE)))
	$(PY) tools.py sample --load $(RUN) $(if $(filter undefined,$(origin PROMPT)),,--prompt "$(PROMPT)") $(ARGS)

# An OpenAI-compatible HTTP server for the run in RUN (serving/server.py; port 8000 unless ARGS="--port N"; NPROC=2 TP=2 serves
# it at TP 2); Ctrl-C or SIGTERM stops it after the requests in flight are answered. NPROC > 1: the flags, the run, its
# layout and the port are checked in one process first (--check-only), so a mistake is one line before torchrun starts.
SERVE   := tools.py serve --load $(RUN) --tensor-model-parallel-size $(TP) $(ARGS)
serve: $(STAMP)
	@$(if $(filter 1,$(NPROC)),:,WORLD_SIZE=$(NPROC) $(PY) $(SERVE) --check-only)
	$(LAUNCH) $(SERVE)

# lm-evaluation-harness on the tasks evaluation/tasks/ ships: the run in RUN served (as make serve serves it; NPROC=2:
# at TP 2 under torchrun) for the evaluation, then stopped; results in $(RUN).eval.json and one table printed
# (evaluation/evaluate.py; ARGS="--hf DIR": lm-eval's hf model on tools.py export's folder instead; ARGS="--harness
# evalscope": EvalScope's evalscope eval against the server, from .venv-evalscope, results in $(RUN).evalscope.json)
eval: $(STAMP) $(if $(findstring evalscope,$(ARGS)),$(ES_STAMP))
	$(PY) tools.py eval --load $(RUN) --nproc $(NPROC) $(ARGS)

# Throughput of the default model: 30 iterations, no evaluation, no checkpoint; prints tokens/s. Then ours vs
# Hugging Face transformers (GPT-2, Llama, BERT, T5, Mamba-2 rows, each in a fresh process), fp32 (bench/bench_hf.py;
# its time and table in bench/README.md).
bench: $(STAMP)
	$(LAUNCH) train.py --model $(MODEL) --tensor-model-parallel-size $(TP) --train-iters 30 --log-interval 10 \
		--eval-iters 0 $(ARGS)
	$(PY) bench/bench_hf.py

# Checkpoint soak test (not in `make test`): a tiny run SIGKILLed and restarted at random moments (some during saves)
# must end bit-identical to an uninterrupted one; ~10 minutes by default (ARGS="--minutes 3").
soak: $(STAMP)
	$(PY) bench/soak.py $(ARGS)

clean:
	rm -rf runs data_cache
