#!/usr/bin/env bash
# Everything measured on the lent H200 in one call (after `source .gpu/setup.sh`): GPU tests,
# CUDA-graph step times, the peer table, offline throughput and the MaskBench end-to-end run
# (LLAMA3_8B=1 adds the Llama-3-8B-shape floor, decode and grammar-overlap runs).
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
if [ -n "${LLAMA3_8B:-}" ]; then  # the Llama-3-8B shape, random weights (benchmarks/assets)
  run hbm_floor_8b 60 python3 benchmarks/hbm_floor.py --model benchmarks/assets/llama3-8b-shape
  run gpu_decode_8b 300 python3 benchmarks/gpu_decode.py --model benchmarks/assets/llama3-8b-shape --load-format dummy --nodes 1 8 --skip-fold
  run grammar_overlap_8b 400 python3 benchmarks/grammar_overlap.py --device cuda --model benchmarks/assets/llama3-8b-shape --load-format dummy --batch 1 8 32 --steps 30 --algorithms ngram draft_model --draft-model benchmarks/assets/llama3-1b-draft-shape
fi
run maskbench 170 python3 benchmarks/maskbench_e2e.py --device cuda --speculative-algorithm ngram --limit 120 --max-tokens 1024 --skip-slow-compile --out "$OUT/maskbench.jsonl"
