#!/usr/bin/env bash
# train-eagle on the lent H200 host, every visible GPU, one stage per device call (after
# `source .gpu/setup.sh`, which puts the SmolLM2 GGUF at $STRUCTSPEC_SMOLLM2_GGUF and the
# ShareGPT wheel on the path). The defaults are the recipe of the shipped head
# (structspec/models/heads/smollm2-135m-instruct-eagle3/README.md):
#   bash benchmarks/train_eagle_gpu.sh data  [DIR]   # ~5 min on one H200: DIR/greedy (every
#                                                    # prompt, greedy) then DIR/sampled (every
#                                                    # ShareGPT prompt again at temperature 0.8)
#   bash benchmarks/train_eagle_gpu.sh train [DIR]   # ~9 min: the head, exported into DIR/head
#   bash benchmarks/train_eagle_gpu.sh eval  [DIR]   # ~6 min: DIR/head's draft vocabulary from
#                                                    # DIR/greedy, then its accept lengths beside
#                                                    # the shipped head, ngram and the self-draft
#                                                    # ceiling (full trees, 32 prompts, 128 tokens)
#   bash benchmarks/train_eagle_gpu.sh synthetic     # ~3 min, no weights or data needed:
#                                                    # training tokens/s and memory at the
#                                                    # SmolLM2 shape (random weights, random ids)
# GPUs: all that `nvidia-smi -L` lists (NGPU=k to use the first k).
# data runs DATA_RANKS engines (default 4 per GPU, round-robin: SmolLM2-135M leaves the GPU idle
# during one engine's host loop; --data-parallel: engine r answers the prompts with
# index % DATA_RANKS == r, the parent merges them into one sequences.npz per pass). Each pass
# stops adding prompts DATA_TIME_LIMIT s (default 430) after it starts and saves; sequences are
# saved in shards as they come, so the same command continues a stopped pass (--resume, with any
# number of GPUs). NUM_SHAREGPT (8994: every train-side ShareGPT prompt under the 1024-token
# cap), MAX_TOKENS (512: new tokens per training answer), NUM_EXTRACTION (1500), NUM_SCHEMA (1300), NUM_SHAREGPT_LATER (0; later human turns of the
# train-side conversations, each alone, in the greedy pass: 37,777 are available), HELD_OUT (256:
# held-out ShareGPT first turns answered greedily, HELD_OUT_TOKENS (128) new tokens each, into DIR/heldout, the evaluation file that
# train then reads with --eval-sequences every EVAL_EVERY (250) steps; 0: none) and SAMPLED (sampled passes: 1; k adds
# DIR/sampled_2 .. DIR/sampled_k with seeds 2 .. k, ~90 s each on one H200; 0: none) override it.
# train runs one process per GPU under torchrun when NGPU > 1 (DistributedDataParallel): each
# optimizer step takes NGPU batches of BATCH_TOKENS (default 32768) tokens, one per GPU; STEPS
# (1500), LR (6e-4), TTT_STEPS (5) and TIME_LIMIT (525 s: it stops, checkpoints and exports
# there) override the recipe; a stopped run continues with EXTRA=--resume. It trains on
# DIR/greedy/sequences.npz and every DIR/sampled*/sequences.npz present.
# data prints a progress line per engine every ~15 s ([data rank R/N] done / total, sequences/s,
# response tokens/s, per source) and a summary per pass; train / synthetic print a summary of the
# training log every 50 steps. Extra train-eagle flags go in $EXTRA (last: they win). DIR
# defaults to out/eagle_smollm2 (under $OUT's folder, so the head comes back with the run's
# files).
set -eu
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stage=${1:?usage: train_eagle_gpu.sh data|train|eval|synthetic [OUT]}
dir=${2:-${OUT:-out}/eagle_smollm2}
EXTRA=${EXTRA:-}
ngpu=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
[ "${ngpu:-0}" -ge 1 ] || ngpu=1
batch_tokens=${BATCH_TOKENS:-32768}
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
    # pass: OUT_SUBDIR then train-eagle data flags
    pass_() {
      local sub=$1; shift
      timeout "$(( ${DATA_TIME_LIMIT:-430} + 130 ))" python3 -m structspec train-eagle \
        --stage data --out "$dir/$sub" --max-tokens "${MAX_TOKENS:-512}" --gen-batch-size 256 \
        --data-time-limit "${DATA_TIME_LIMIT:-430}" --data-parallel "$data_ranks" --resume \
        --no-progress "$@" $EXTRA
    }
    pass_ greedy --num-sharegpt "${NUM_SHAREGPT:-8994}" \
      --num-extraction "${NUM_EXTRACTION:-1500}" --num-schema "${NUM_SCHEMA:-1300}" \
      --num-sharegpt-later "${NUM_SHAREGPT_LATER:-0}"
    # evaluation data: held-out ShareGPT first turns (the last ones; benchmarks read the first),
    # answered greedily; the train stage evaluates on it and never trains on it. 128 new tokens,
    # as eagle_accept.py measures: SmolLM2's greedy answers grow repetitive toward 512 tokens,
    # and the head's agreement there (0.87 at TTT step 0 in round 3) says little about the
    # start of an answer (0.65 on eagle_accept's first 128 tokens, the same head)
    if [ "${HELD_OUT:-256}" -gt 0 ]; then
      pass_ heldout --num-sharegpt 0 --num-extraction 0 --num-schema 0 \
        --num-sharegpt-held-out "${HELD_OUT:-256}" --max-tokens "${HELD_OUT_TOKENS:-128}"
    fi
    # sampled passes: seed 1 -> DIR/sampled, seed k > 1 -> DIR/sampled_k
    for k in $(seq 1 "${SAMPLED:-1}"); do
      sub=sampled
      if [ "$k" -gt 1 ]; then sub=sampled_$k; fi
      pass_ "$sub" --num-sharegpt "${NUM_SHAREGPT:-8994}" --num-extraction 0 --num-schema 0 \
        --temperature 0.8 --seed "$k"
    done
    ls -la "$dir"/* ;;
  train)
    seqs="$dir/greedy/sequences.npz"
    for f in "$dir"/sampled/sequences.npz "$dir"/sampled_*/sequences.npz; do
      if [ -f "$f" ]; then seqs="$seqs $f"; fi
    done
    evals=""
    if [ -f "$dir/heldout/sequences.npz" ]; then
      evals="--eval-sequences $dir/heldout/sequences.npz --eval-every ${EVAL_EVERY:-250}"
    fi
    train_eagle --stage train --out "$dir/head" --sequences $seqs $evals --steps "${STEPS:-1500}" \
      --batch-tokens "$batch_tokens" --max-seq-len 2048 --ttt-steps "${TTT_STEPS:-5}" \
      --lr "${LR:-6e-4}" --warmup-steps 60 --checkpoint-every 250 \
      --time-limit "${TIME_LIMIT:-525}" --no-progress $EXTRA
    summary "$dir/head/train_log.jsonl"
    if [ -f "$dir/head/eval_log.jsonl" ]; then cat "$dir/head/eval_log.jsonl"; fi
    ls -la "$dir/head" ;;
  eval)
    python3 -m structspec.speculative.draft_vocab --data "$dir/greedy/sequences.npz" \
      --head "$dir/head" --vocab-size 49152 --size "${DRAFT_VOCAB:-16384}"
    accept() {
      timeout "$1" python3 benchmarks/eagle_accept.py --device cuda --num-prompts 32 \
        --max-tokens 128 --speculative-adaptive off "${@:2}" 2>&1 | grep '^eagle_accept' || true
    }
    # the gate row first: the new head and the ceiling on held-out ShareGPT
    accept 170 --draft-model "$dir/head" --algorithms eagle draft_model --workloads sharegpt \
      --shapes tree
    accept 110 --algorithms eagle --workloads sharegpt maskbench --shapes tree   # shipped head
    accept 200 --draft-model "$dir/head" --algorithms eagle ngram --workloads maskbench \
      extraction --shapes tree chain
    accept 60 --draft-model "$dir/head" --algorithms eagle --workloads sharegpt --shapes chain ;;
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
