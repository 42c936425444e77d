#!/usr/bin/env bash
# Everything measured on the lent H200 in one call (after `source .gpu/setup.sh`): GPU tests,
# CUDA-graph step times, the peer table, offline throughput and the MaskBench end-to-end run.
# Logs go to $OUT (or ./out); each step is bounded so one failure does not hide the others.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
run() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? $name"; tail -n 12 "$OUT/$name.log"; }
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
run gpu_tests 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/engine/test_gpu_engine.py tests/engine/test_cuda_graph.py tests/spec tests/grammar
[ -n "${SKIP_DECODE:-}" ] || run gpu_decode 50 python3 benchmarks/gpu_decode.py
run peer_compare 130 python3 benchmarks/peer_compare.py --device cuda --num-requests 8
run offline 80 python3 benchmarks/offline.py --device cuda --algorithms none ngram --num-requests 64
run maskbench 170 python3 benchmarks/maskbench_e2e.py --device cuda --speculative-algorithm ngram --limit 120 --max-tokens 1024 --skip-slow-compile --out "$OUT/maskbench.jsonl"
