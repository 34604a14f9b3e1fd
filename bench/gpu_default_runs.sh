#!/bin/bash
# The README's "same default runs on one H200" table: eight default training runs side by side on one GPU (each
# pinned to 2 cores), 500 iterations each, plus the CUDA tests. Run on a GPU machine from the repository root with
#   bash bench/gpu_default_runs.sh OUTDIR
# The stdlib corpus depends on the Python that reads it, so export this machine's first (same documents -> the same
# tokenizer and token-cache key, so the GPU runs see exactly the tokens `make train` sees here):
#   .venv/bin/python -c "import json, data; [print(json.dumps({'text': d})) for d in data.load_documents(None)]" \
#       > .devdata/stdlib.jsonl; mkdir -p .devdata/cache; cp data_cache/*-bpe8192.json data_cache/*-tokens.* .devdata/cache/
# (The README's bert rows ran with that day's BERT defaults: learned positions, lr 1e-3.)
set -u
OUT=${1:?usage: bench/gpu_default_runs.sh OUTDIR}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
D="--data-path .devdata/stdlib.jsonl --data-cache-dir .devdata/cache"
R=$OUT/runs; mkdir -p $R; i=0; pids=()
run() { local name=$1; shift; local c="$((2*i)),$((2*i+1))"; i=$((i+1))
  ( s=$SECONDS; timeout 300 taskset -c $c python3 train.py $D --save $R/$name "$@" > $R/$name.log 2>&1
    echo "$name rc=$? wall $((SECONDS-s)) s" >> $R/rc.txt ) & pids+=($!); }
run gpt_fp32 --model gpt
run gpt_fp8 --model gpt --fp8
run gpt_moe --model gpt --num-experts 4 --moe-router-topk 2
run bert_default --model bert
run bert_lr3e-3 --model bert --lr 3e-3 --min-lr 3e-4
run bert_2000 --model bert --train-iters 2000
run t5 --model t5
run mamba --model mamba
timeout 280 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py tests/test_fp8.py > $OUT/pytest.txt 2>&1
wait "${pids[@]}"  # not a bare `wait`: that would also wait for process substitutions
cat $R/rc.txt; grep -h "validation loss" $R/*.log | tail -20
