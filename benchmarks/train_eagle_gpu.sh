#!/usr/bin/env bash
# train-eagle on the lent H200, one stage per device call (after `source .gpu/setup.sh`, which
# puts the SmolLM2 GGUF at $STRUCTSPEC_SMOLLM2_GGUF and the ShareGPT wheel on the path):
#   bash benchmarks/train_eagle_gpu.sh data  [OUT]   # <= 7 min: prompts -> target answers;
#                                                    # run again to continue where it stopped
#   bash benchmarks/train_eagle_gpu.sh train [OUT]   # ~10 min: the head, exported into OUT
#   bash benchmarks/train_eagle_gpu.sh synthetic     # ~3 min, no weights or data needed:
#                                                    # training tokens/s and memory at the
#                                                    # SmolLM2 shape (random weights, random ids)
# data prints a progress line every ~15 s (done / total, sequences/s, response tokens/s, per
# source) and a summary; train / synthetic print
# the tqdm bar (loss, per-TTT-step top-1 agreement, tokens/s) and a summary of
# OUT/train_log.jsonl every 50 steps. Extra train-eagle flags go in $EXTRA. OUT defaults to
# out/eagle_smollm2 (under $OUT's folder, so the head comes back with the run's files).
set -eu
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stage=${1:?usage: train_eagle_gpu.sh data|train|synthetic [OUT]}
dir=${2:-${OUT:-out}/eagle_smollm2}
EXTRA=${EXTRA:-}
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
summary() {
  python3 - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for r in rows[::50] + rows[-1:]:
    print(f"step {r['step']:5d} loss {r['loss']:.4f} acc {r['acc']} tok/s {r['tokens_per_s']:.0f} "
          f"rows {r['rows']} lr {r['lr']:.2e} peak_gpu_gib {r.get('peak_gpu_gib')}")
PY
}
case $stage in
  data)
    # Stops adding prompts 420 s after the stage starts (model load included) and saves,
    # well inside the call's timeout; sequences are saved in shards as they come, so even a
    # kill keeps them, and the next call with the same command continues (--resume).
    timeout 560 python3 -m structspec train-eagle --stage data --out "$dir" \
      --num-sharegpt 8900 --num-extraction 1500 --num-schema 1300 --max-tokens 512 \
      --gen-batch-size 256 --data-time-limit 430 --resume --no-progress $EXTRA
    ls -la "$dir" ;;
  train)
    python3 -m structspec train-eagle --stage train --out "$dir" --epochs 6 \
      --batch-tokens 65536 --max-seq-len 2048 --ttt-steps 7 --lr 5e-4 --warmup-steps 50 \
      --checkpoint-every 250 --time-limit 480 $EXTRA
    summary "$dir/train_log.jsonl"
    ls -la "$dir" ;;
  synthetic)
    d=/tmp/eagle_synth; mkdir -p $d
    python3 benchmarks/train_eagle_synthetic.py $d/sequences.npz --num 3000
    python3 -m structspec train-eagle --stage train --out $d \
      --model benchmarks/assets/smollm2-135m-shape --load-format dummy --steps 400 \
      --batch-tokens 65536 --max-seq-len 2048 --ttt-steps 7 --checkpoint-every 0 \
      --time-limit 120 --no-progress $EXTRA
    summary $d/train_log.jsonl ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
