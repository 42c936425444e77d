#!/usr/bin/env bash
# train-eagle on the lent H200 host, every visible GPU, one stage per device call (after
# `source .gpu/setup.sh`, which puts the SmolLM2 GGUF at $STRUCTSPEC_SMOLLM2_GGUF and the
# ShareGPT wheel on the path):
#   bash benchmarks/train_eagle_gpu.sh data  [OUT]   # <= 7 min: prompts -> target answers;
#                                                    # run again to continue where it stopped
#   bash benchmarks/train_eagle_gpu.sh train [OUT]   # ~8 min: the head, exported into OUT
#   bash benchmarks/train_eagle_gpu.sh synthetic     # ~3 min, no weights or data needed:
#                                                    # training tokens/s and memory at the
#                                                    # SmolLM2 shape (random weights, random ids)
# GPUs: all that `nvidia-smi -L` lists (NGPU=k to use the first k). data runs DATA_RANKS engines
# (default 4 per GPU, round-robin; --data-parallel: engine r answers the prompts with
# index % DATA_RANKS == r, the parent merges them into OUT/sequences.npz); NUM_SHAREGPT (8994:
# every train-side ShareGPT prompt under the 1024-token cap), NUM_EXTRACTION, NUM_SCHEMA,
# DATA_TIME_LIMIT (430 s) and DATA_TIMEOUT (560 s) override the prompt set and the limits; train and synthetic run one process per GPU under torchrun
# (DistributedDataParallel): each optimizer step takes NGPU batches of BATCH_TOKENS (default
# 65536) tokens, one per GPU, so a step's global batch is NGPU x BATCH_TOKENS and an epoch has
# NGPU times fewer steps; EPOCHS defaults to 6 x NGPU (the optimizer steps of one GPU's 6
# epochs, each on NGPU times the tokens). NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
# data prints a progress line per GPU every ~15 s ([data rank R/N] done / total, sequences/s,
# response tokens/s, per source) and a summary over all; train / synthetic print the tqdm bar
# (loss, per-TTT-step top-1 agreement, global tokens/s) and a summary of OUT/train_log.jsonl
# every 50 steps. Extra train-eagle flags go in $EXTRA. OUT defaults to out/eagle_smollm2
# (under $OUT's folder, so the head comes back with the run's files).
set -eu
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stage=${1:?usage: train_eagle_gpu.sh data|train|synthetic [OUT]}
dir=${2:-${OUT:-out}/eagle_smollm2}
EXTRA=${EXTRA:-}
ngpu=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
[ "${ngpu:-0}" -ge 1 ] || ngpu=1
batch_tokens=${BATCH_TOKENS:-65536}
epochs=${EPOCHS:-$((6 * ngpu))}
# data engines: DATA_RANKS in all (default 4 per GPU: SmolLM2-135M leaves the GPU idle during
# one engine's host loop, see benchmarks/README.md)
data_ranks=${DATA_RANKS:-$((4 * ngpu))}
python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count(), "x",
                                torch.cuda.get_device_name())'
echo "GPUs used: $ngpu"
# one process, or one per GPU under torchrun
train_eagle() {
  if [ "$ngpu" -gt 1 ]; then
    python3 -m torch.distributed.run --standalone --nproc-per-node "$ngpu" \
      -m structspec train-eagle "$@"
  else
    python3 -m structspec train-eagle "$@"
  fi
}
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
    # Stops adding prompts 430 s after the stage starts (model load included) and saves,
    # well inside the call's timeout; sequences are saved in shards as they come, so even a
    # kill keeps them, and the next call with the same command continues (--resume, with any
    # number of GPUs).
    timeout "${DATA_TIMEOUT:-560}" python3 -m structspec train-eagle --stage data --out "$dir" \
      --num-sharegpt "${NUM_SHAREGPT:-8994}" --num-extraction "${NUM_EXTRACTION:-1500}" \
      --num-schema "${NUM_SCHEMA:-1300}" --max-tokens 512 --gen-batch-size 256 \
      --data-time-limit "${DATA_TIME_LIMIT:-430}" --data-parallel "$data_ranks" --resume \
      --no-progress $EXTRA
    ls -la "$dir" ;;
  train)
    train_eagle --stage train --out "$dir" --epochs "$epochs" \
      --batch-tokens "$batch_tokens" --max-seq-len 2048 --ttt-steps 7 --lr 5e-4 \
      --warmup-steps 50 --checkpoint-every 250 --time-limit 480 $EXTRA
    summary "$dir/train_log.jsonl"
    ls -la "$dir" ;;
  synthetic)
    d=/tmp/eagle_synth; mkdir -p $d
    python3 benchmarks/train_eagle_synthetic.py $d/sequences.npz --num 3000
    train_eagle --stage train --out $d \
      --model benchmarks/assets/smollm2-135m-shape --load-format dummy --steps 400 \
      --batch-tokens "$batch_tokens" --max-seq-len 2048 --ttt-steps 7 --checkpoint-every 0 \
      --time-limit 120 --no-progress $EXTRA
    summary $d/train_log.jsonl ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
