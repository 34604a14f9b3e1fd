#!/bin/bash
# bench/README.md's "Default runs on one H200 (GPU)": eight training runs side by side on one GPU (each pinned to 2
# cores), then the CUDA tests. Run on a GPU machine from the repository root with
#   bash bench/gpu_default_runs.sh OUTDIR
# Each run's flags are spelled out as measured on 2026-11-30 (that day's defaults: 500 iterations for gpt; BERT with
# learned positions and lr 1e-3; Mamba with one group), so the table's rows stay reproducible as the defaults move.
# The stdlib corpus depends on the Python that reads it, so export the CPU machine's first (same documents -> the same
# tokenizer and token-cache key, so the GPU runs see exactly the tokens `make train` sees there):
#   .venv/bin/python -c "import json, data; [print(json.dumps({'text': d})) for d in data.load_documents(None)]" \
#       > .devdata/stdlib.jsonl; mkdir -p .devdata/cache; cp data_cache/*-bpe8192.json data_cache/*-tokens.* .devdata/cache/
# Without .devdata/stdlib.jsonl the script exports this machine's own stdlib (other documents, other figures).
# PYTHON: the interpreter with torch (default python3, the GPU image's).
set -u
OUT=${1:?usage: bench/gpu_default_runs.sh OUTDIR}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
if [ ! -f .devdata/stdlib.jsonl ]; then
  mkdir -p .devdata/cache
  $PY -c "import json, data; [print(json.dumps({'text': d})) for d in data.load_documents(None)]" > .devdata/stdlib.jsonl
fi
D="--data-path .devdata/stdlib.jsonl --data-cache-dir .devdata/cache --optimizer adam"  # AdamW: the default then
R=$OUT/runs; mkdir -p $R; i=0; pids=()
run() { local name=$1; shift; local c="$((2*i)),$((2*i+1))"; i=$((i+1))
  ( s=$SECONDS; timeout 300 taskset -c $c $PY train.py $D --save $R/$name "$@" > $R/$name.log 2>&1
    echo "$name rc=$? wall $((SECONDS-s)) s" >> $R/rc.txt ) & pids+=($!); }
B="--model bert --position-embedding-type learned_absolute"
run gpt_fp32 --model gpt --train-iters 500
run gpt_fp8 --model gpt --train-iters 500 --fp8  # no row in the table: not measured since the FP8 amax fix
run gpt_moe --model gpt --train-iters 500 --num-experts 4 --moe-router-topk 2
run bert_default $B --lr 1e-3 --min-lr 1e-4
run bert_lr3e-3 $B --lr 3e-3 --min-lr 3e-4
run bert_2000 $B --lr 1e-3 --min-lr 1e-4 --train-iters 2000
run t5 --model t5 --train-iters 500
run mamba --model mamba --mamba-num-groups 1 --train-iters 500
timeout 280 $PY -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py tests/test_fp8.py > $OUT/pytest.txt 2>&1
wait "${pids[@]}"  # not a bare `wait`: that would also wait for process substitutions
cat $R/rc.txt; grep -h "validation loss" $R/*.log | tail -20
