#!/usr/bin/env bash
# Everything measured on the lent H200 (after `source .gpu/setup.sh`), in stages named on the
# command line so that each fits one device call:
#   bash benchmarks/gpu_suite.sh tests smol peer llama8b llama8b_overlap invariant maskbench
#   loopguards loopguards2 penalty_cost eagle_speed (the default: those eleven; every other stage
#   below runs only when named; an unknown name makes the script exit 1 after the others)
#   tests     GPU tests (kernels, CUDA graphs, engine: overlap on/off, bf16 spec vs plain, sync)
#   smol      SmolLM2: host mask-build cost by threads, CUDA-graph step times, grammar overlap
#             (ngram and draft_model, batch 1/8/32/64, N=8, with / without grammar and overlap)
#   peer      the peer table: HF generate (+ xgrammar) vs structspec, batch 1 and 64
#   llama8b   Llama-3-8B shape (random bf16 weights, real Llama-3 tokenizer): HBM floor, decode
#             step vs floor (skinny GEMM and cuBLAS), per-layer GEMM micro-benchmark
#   llama8b_overlap  the 8B shape's grammar overlap (ngram and draft_model with a 1B-shape
#             draft, 2 repeats)
#   invariant the cost of --batch-invariant (decode / verify step times, SmolLM2 and 8B shapes;
#             the default mode's are in smol / llama8b)
#   maskbench MaskBench end to end (120 schemas)
#   loopguards, loopguards2  issue 20: MaskBench (120 schemas, ngram, greedy, max 512 tokens)
#             without the number bounds, with the defaults, with frequency / repetition
#             penalties and with the repetition stop: the truncated share of each
#   penalty_cost  issue 20: verify-step time of penalised batches vs none (ngram, batch
#             1/32/64; the penalised post graph), one line per configuration
#   eagle_speed  issue 18: tokens/s of none / ngram / eagle / draft_model at batch 1/8/32/64, with
#             and without a JSON Schema, held-out ShareGPT and extraction prompts (drafter_speed.py
#             --compact, ~3 min), and the grammar overlap with the shipped EAGLE head (batch
#             1/8/32/64, overlap on, 3 alternating repeats, ~3 min)
#   eagle_speed2  issue 18: none vs eagle with full trees every step (--speculative-adaptive off,
#             128 new tokens, 4 prompts at batch 1: the compact run's windows were 0.2-1.4 s and its
#             batch-8 accept lengths looked like the adaptive sizing, not the drafter), then the
#             EAGLE grammar overlap (2 alternating repeats), host profiles of eagle / none steps
#   drafter_maskbench  issue 18: MaskBench end to end (120 schemas, greedy, N=8, 512 tokens)
#             with ngram and eagle at batch 64 and 1: tok/s and accept length (~4-7 min;
#             MB_BS="64" or "1" runs one batch size, MB_ALGOS a subset of the drafters)
#   keyed_graphs  the keyed graphs (runner/keyed_graphs.py: the EAGLE feature store) against
#             their eager functions on CUDA, with the EAGLE tests
#   host_step_eagle  host_step_cost for eagle + JSON alone (~2 min)
#   eagle_bs1  issue 18: the batch-1 gate's row (ShareGPT + JSON Schema, none vs eagle) with the
#             adaptive sizer (auto) and with full trees at depths 3 / 4 / 5 (~5 min; needs
#             .whl_sharegpt/ carried to this machine: drafter_speed exits at once without it)
#   eagle_tests  issue 18: tests/engine/test_gpu_engine.py alone (no-sync steps with every drafter
#             and the shipped EAGLE head, bf16 and batch-invariant spec vs plain with ngram and
#             eagle; did not finish in 300 s on 2026-12-03: five engines' captures first, so a
#             call of its own)
#   eagle_workers  issue 18: the mask workers' barrier for device trees on CUDA (no-sync test
#             with the shipped head, tests/engine/test_gpu_mask_workers.py), then the EAGLE
#             grammar overlap at batch 1/8/32/64 (2 alternating repeats; ~6 min)
#   index_kernels  issue 18: the index kernels (EAGLE-2 expansion, tree layout, page lookups,
#             catch-up layout: kernels/draft_tree.py, kernels/paging.py) on CUDA: their tests, the
#             GEMV / staging / propose-graph / EAGLE tests, then host_step_cost with them on and
#             off (STRUCTSPEC_INDEX_KERNELS=0) (~5-6 min)
#   eagle_bs1_pair  issue 18: the batch-1 gate's row, none and eagle in one run (~3.5 min)
#   eagle_bs1_ab  issue 18: the batch-1 gate's eagle row with EAGLE prompts prefilled eagerly
#             (STRUCTSPEC_FEATURE_PREFILL_GRAPHS=0; run after eagle_bs1_pair on one machine), then
#             the EAGLE grammar overlap at batch 32 alone, 4 alternating repeats
#   overlap_bs64  issue 19's llguidance overlap at batch 64 (ngram, 3 repeats), then issue 18's
#             EAGLE overlap at batch 1/8/32/64 (3 repeats; ~7-9 min)
#   llguidance_bs64_workers  issue 19: llguidance grammar overlap at batch 64 (ngram, 3 repeats)
#             with 8 mask workers (the default on 16 cores) and with 12
#   feature_graph  issue 18: the EAGLE tests on CUDA (the feature-store graph vs the eager store,
#             no host sync in its replays), the paging / GEMV / tree-kernel / staging tests (~4 min)
#   eagle_bs1_auto  issue 18: host_step_cost (host us per call and the GPU's view of the same
#             steps), then the batch-1 gate's row with the default sizer (auto) (~4.5 min)
#   host_step_batch  issue 18: where an EAGLE + JSON step's host time goes at batch 8 and 32
#             (host_step_cost.py --batch 8 32 --grammar both, wrapped calls, cProfile top rows),
#             after the EAGLE grammar overlap at batch 8 / 32 (1 repeat: is this host slow?)
#   host_step_marks  issue 18: the EAGLE grammar overlap at batch 8 / 32 / 64 with the pool's
#             round-trip marks (1 repeat), then host_step_cost of the batch-8 EAGLE + JSON step
#   host_trace_bs32  issue 18: torch.profiler of the batch-32 EAGLE step with / without a JSON
#             Schema (host ops by own time), the overlap at batch 32 with 0 and 4 mask workers
#   packed_overlap  the packed tree links' CUDA tests, then the llguidance batch-64 overlap (3
#             repeats) and the EAGLE overlap at batch 1/8/32/64 (2 repeats) (~8 min)
#   spin_ab   the mask workers' spin window 0 vs 20 ms: EAGLE grammar overlap at batch 8 and 32
#   order_ab  issue 18: the CUDA mask-worker tests, then the EAGLE grammar overlap at batch
#             8 / 32 / 64 on one engine with the build sent after / before the verify launch
#             (1 repeat; the run of 2026-12-04 also had --reply-spin off on, removed since)
#   new_gpu_tests  the min_tokens / allowed_token_ids GPU tests (no sync; batch-invariant spec
#             equals plain), after the Triton warm-up (~3-6 min on a fresh machine)
#   inproc_ab  the EAGLE gate at batch 8 / 32 with the grammar walked in the engine process
#             (--grammar-workers 0) against the 8 mask workers, processes alternating (~4 min)
#   pool_host  the engine thread's CPU time for a step's grammar work with 8 spinning mask
#             workers on this host (pool_host_cost.py, batch 8 / 32 / 64; CPU only)
#   sampler   the cost of drawing a step's sampled rows (sampler_cost.py: keyed by seed and
#             position) on the GPU, by rows and filter
#   gates     issues 18/19: the two overlap conditions still open, alternating repeats (9 x 40
#             steps, 7 x 100): EAGLE + JSON at batch 1 / 8 / 32 / 64, llguidance ngram at batch
#             64 (~3-5 min)
#   mailbox_ab  issue 18: the workers' shared-memory mailboxes against their sockets (processes
#             alternating), EAGLE grammar overlap at batch 8 / 32 / 64
#   gate_ab   issues 18/19: the upload behind a device-side wait on the mask workers' flags (the
#             default) against the host's wait for their replies, processes alternating: EAGLE
#             grammar overlap at batch 8 / 32 / 64 (GATE_AB="1 0 1 0" picks the order)
#   gate_tests  the mask-worker GPU tests (the device gate's no-sync steps, a worker killed
#             under it)
#   workers_ab  issues 18/19: 8 against 12 mask workers (processes alternating): the EAGLE grammar
#             overlap at batch 32 / 64, llguidance ngram at batch 64
#   text_ab   issue 18: the EAGLE grammar overlap at batch 8 / 32 / 64 with a device tree's text
#             work while the tree is on its way and after it (one engine, 2 repeats), batch 1
#             (TEXT_AB_BATCH="32 64" and TEXT_AB_REPEATS=4 change the first run's batches and
#             repeats)
#   host_step  issue 18: host us per batch-1 step of each call a verify step makes (none and
#             eagle with a JSON Schema), and the host cost of one forward-graph launch
#             (host_step_cost.py, ~1.5 min)
#   eagle_trace  issue 18: torch.profiler over 200 steady EAGLE / none steps at batch 1 with a
#             JSON Schema (profile_step.py --trace: host and kernel time per step phase, kernels
#             per step, top kernels): is the propose bound by its kernels or its launches?
#   serving_core  issue 21: the prefill-graph test, a 7,000-token prompt arriving while 32 streams
#             decode (ITL per chunk budget, profiled), a short request behind 40 long, the CUDA
#             serving-core tests (prefix cache / chunked == unchunked, one engine per drafter)
#   eagle_prefill  issue 18: EAGLE prompts through the prefill graphs' feature variant: the
#             prefill-graph tests on CUDA, the serving-core tests with eagle (prefix cache on ==
#             off, chunked == unchunked). On a fresh machine the Triton compiles of float32
#             kernels come first: 80 s did not finish the prefill-graph file (2026-12-04). The
#             batch-1 gate's row after it: eagle_bs1_pair
#   mixed_tree  the no-sync tests with mixed tree sizes and every drafter (4 engines, ~4-8 min)
#   prefix_distinct  issue 21: shared 2k-token prefix, cache on / off (256 requests, 64 running);
#             issue 17: distinct schemas per request, ngram, 0 vs 8 mask workers, 3 alternating repeats
#   mixed_tree_ngram  the n-gram no-sync test with mixed tree sizes alone (two plain engines,
#             ~1-2 min: the GuardedDrafter merge fix of 2026-12-03)
#   attn      issue 21: the attention kernel tests, and a prompt chunk's attention under the
#             masked kernel vs the causal-chain kernel per tile config (attention_causal.py)
#   itl       issue 21: the prefill-graph test, the chunked-prefill ITL (budget 512), once plain
#             and once profiled (host time of every prefill / verify step in order)
#   llguidance  issue 19: the llguidance tokenizer tests (this host's transformers), the host's
#             tree-mask cost per backend (tree_mask_cost.py, 8 worker processes), MaskBench end
#             to end with --grammar-backend auto (greedy)
#   llguidance_overlap  issue 19: grammar overlap with every request on llguidance (ngram,
#             batch 1/8/32/64, 150 steps, 3 repeats: 60-step pairs spread 0.98-1.39 at batch 8)
#   llguidance_bs8  issue 19: the same at batch 8 alone, 5 repeats (~2-3 min; the one batch size
#             above the gate, 1.067, with a repeat spread as wide as the distance to it)
#   llguidance2  issue 19: first-request TTFT per backend, MaskBench auto at T=0.6
#   ab_overlap, ab_peer  this checkout against another one at $OLD (e.g. `git archive` of an
#             earlier commit), alternated back to back (benchmarks/ab_compare.py): grammar
#             overlap (ngram, batch 1/32/64, overlap on) and the structspec peer-table rows;
#             not in the default list
# Logs go to $OUT (or ./out); each step is time-bounded so one failure does not hide the others.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
run() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? $name"; grep -E "^(# [a-z_]+ batch=|trace |host_step|gpu_step|graph_launch|tree_mask_cost|attention_causal|best per|Q=|ab_compare|drafter_speed|eagle_accept|grammar_overlap|mask_build|decode|peer|hbm|floor|maskbench|penalty_cost|config=|prefix_cache|distinct_schemas|pool_host_cost|sampler_cost|ttft|gate|  errors|[0-9]+ passed|FAILED|ERROR)|passed|failed" "$OUT/$name.log" | tail -n 40; }
# A short eagle run (every Triton kernel it launches): a fresh machine's first process
# pays Triton's JIT cache (MaskBench batch 1: 418.6 tok/s as the first run, 946.1 warm)
warm_triton() { run triton_warmup 120 python3 benchmarks/maskbench_e2e.py --device cuda --speculative-algorithm eagle --limit 4 --max-tokens 64 --skip-slow-compile --max-batch-size 4 --out "$OUT/triton_warmup.jsonl"; }
stages=${*:-tests smol peer llama8b llama8b_overlap invariant maskbench loopguards loopguards2 penalty_cost eagle_speed}
L8=benchmarks/assets/llama3-8b-shape
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
for s in $stages; do case $s in
  tests)
    run gpu_tests 480 python3 -m pytest -q -s -p no:cacheprovider tests/kernels tests/engine/test_gpu_engine.py tests/engine/test_cuda_graph.py tests/speculative tests/grammar/test_worker_pool.py tests/engine/test_penalty_graph.py tests/engine/test_graph_warmup.py ;;
  drafter_maskbench)
    # a short run first: a fresh machine's first process pays Triton's JIT cache (MaskBench at
    # batch 1 measured 418.6 tok/s as the first run, 946.1 once the cache was warm)
    warm_triton
    for algo in ${MB_ALGOS:-ngram eagle}; do for bs in ${MB_BS:-64 1}; do
      run "maskbench_${algo}_bs${bs}" 150 python3 benchmarks/maskbench_e2e.py --device cuda --speculative-algorithm "$algo" --limit 120 --max-tokens 512 --skip-slow-compile --max-batch-size "$bs" --out "$OUT/maskbench_${algo}_bs${bs}.jsonl"
    done; done ;;
  eagle_bs1)
    DS="python3 benchmarks/drafter_speed.py --device cuda --workloads sharegpt --grammar json_schema --batch 1 --max-tokens 128 --batch1-prompts 8"
    run ds_bs1_none 150 $DS --algorithms none
    run ds_bs1_eagle_auto 150 $DS --algorithms eagle
    run ds_bs1_eagle_off 150 $DS --algorithms eagle --speculative-adaptive off
    run ds_bs1_eagle_off_d3 150 $DS --algorithms eagle --speculative-adaptive off --depth 3
    run ds_bs1_eagle_off_d5 150 $DS --algorithms eagle --speculative-adaptive off --depth 5 ;;
  index_kernels)
    run index_kernel_tests 300 python3 -m pytest -q -s -p no:cacheprovider tests/kernels/test_draft_tree.py tests/kernels/test_paging.py tests/kernels/test_gemv.py tests/test_staging.py tests/speculative/test_draft_graph.py tests/speculative/test_eagle.py
    run host_step_index_on 150 python3 benchmarks/host_step_cost.py --algorithms none eagle --grammar --steps 300
    STRUCTSPEC_INDEX_KERNELS=0 run host_step_index_off 100 python3 benchmarks/host_step_cost.py --algorithms eagle --grammar --steps 300 ;;
  keyed_graphs)
    run keyed_graph_tests 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_keyed_graphs.py tests/speculative/test_eagle.py ;;
  feature_graph)
    run feature_graph_tests 280 python3 -m pytest -q -s -p no:cacheprovider tests/speculative/test_eagle.py tests/kernels/test_paging.py tests/kernels/test_gemv.py tests/kernels/test_draft_tree.py tests/test_staging.py ;;
  eagle_bs1_auto)
    run host_step_cost 200 python3 benchmarks/host_step_cost.py --algorithms none eagle --grammar --steps 300
    run ds_bs1_auto 240 python3 benchmarks/drafter_speed.py --device cuda --workloads sharegpt --grammar json_schema --batch 1 --max-tokens 128 --batch1-prompts 8 --algorithms none eagle ;;
  eagle_bs1_pair)
    run ds_bs1_pair 300 python3 benchmarks/drafter_speed.py --device cuda --workloads sharegpt --grammar json_schema --batch 1 --max-tokens 128 --batch1-prompts 8 --algorithms none eagle ;;
  eagle_bs1_ab)
    STRUCTSPEC_FEATURE_PREFILL_GRAPHS=0 run ds_bs1_eager_prefill 240 python3 benchmarks/drafter_speed.py --device cuda --workloads sharegpt --grammar json_schema --batch 1 --max-tokens 128 --batch1-prompts 8 --algorithms eagle
    run grammar_overlap_eagle_bs32 200 python3 benchmarks/grammar_overlap.py --device cuda --batch 32 --steps 60 --algorithms eagle --overlap on --repeats 4 --speculative-adaptive off ;;
  overlap_bs64)
    # issue 19's batch-64 row (every request on llguidance) and issue 18's EAGLE overlap at
    # batch 1/8/32/64, 3 alternating repeats each (~7-9 min)
    run grammar_overlap_llg_bs64 170 python3 benchmarks/grammar_overlap.py --device cuda --batch 64 --steps 150 --algorithms ngram --overlap on --repeats 3 --grammar-backend llguidance
    run grammar_overlap_eagle 400 python3 benchmarks/grammar_overlap.py --device cuda --batch 1 8 32 64 --steps 60 --algorithms eagle --overlap on --repeats 3 --speculative-adaptive off ;;
  llguidance_bs64_workers)
    for w in 8 12; do
      run grammar_overlap_llg_bs64_w$w 150 python3 benchmarks/grammar_overlap.py --device cuda --batch 64 --steps 150 --algorithms ngram --overlap on --repeats 3 --grammar-backend llguidance --grammar-workers $w
    done ;;
  eagle_tests)
    run gpu_engine_tests 560 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_engine.py ;;
  eagle_workers)
    run gpu_mask_worker_tests 200 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_mask_workers.py
    run grammar_overlap_eagle 260 python3 benchmarks/grammar_overlap.py --device cuda --batch 1 8 32 64 --steps 60 --algorithms eagle --overlap on --repeats 2 --speculative-adaptive off ;;
  host_step_eagle)
    run host_step_eagle 150 python3 benchmarks/host_step_cost.py --algorithms eagle --grammar --steps 300 ;;
  host_step_batch)
    run grammar_overlap_eagle_8_32 200 python3 benchmarks/grammar_overlap.py --device cuda --batch 8 32 --steps 60 --algorithms eagle --overlap on --repeats 1 --speculative-adaptive off
    run host_step_batch 300 python3 benchmarks/host_step_cost.py --algorithms eagle --grammar both --batch 8 32 --steps 150 --profile "$OUT/host_step" --top 45 ;;
  host_step_marks)
    # the pool round trip's marks (first worker start, last reply, read) per batch size, then
    # the wrapped calls of the batch-8 EAGLE + JSON step
    run grammar_overlap_eagle_marks 260 python3 benchmarks/grammar_overlap.py --device cuda --batch 8 32 64 --steps 60 --algorithms eagle --overlap on --repeats 1 --speculative-adaptive off
    run host_step_json_bs8 150 python3 benchmarks/host_step_cost.py --algorithms eagle --grammar on --batch 8 --steps 200 ;;
  host_trace_bs32)
    # is the batch-32 EAGLE + JSON step's extra host time in CUDA runtime calls, in Python, or
    # contention with the mask workers? torch.profiler of the step with and without the
    # grammar, then the overlap at batch 32 with 0 and 4 mask workers (8 is the default)
    lscpu | grep -E "Thread|Core|Socket|NUMA node\(s\)"
    run trace_eagle_json_bs32 150 python3 benchmarks/profile_step.py --algorithm eagle --batch 32 --steps 100 --grammar --trace --top 30
    run trace_eagle_none_bs32 150 python3 benchmarks/profile_step.py --algorithm eagle --batch 32 --steps 100 --trace --top 30
    for w in 0 4; do
      run grammar_overlap_eagle_bs32_w$w 120 python3 benchmarks/grammar_overlap.py --device cuda --batch 32 --steps 60 --algorithms eagle --overlap on --repeats 1 --speculative-adaptive off --grammar-workers $w
    done ;;
  packed_overlap)
    # the packed tree links on CUDA (staging tests, propose graphs vs eager), then issue 19's
    # llguidance batch-64 row (3 repeats) and issue 18's EAGLE overlap (2 repeats) (~8 min)
    run packed_links_tests 120 python3 -m pytest -q -p no:cacheprovider tests/grammar/test_tree_mask.py tests/speculative/test_draft_graph.py
    run grammar_overlap_llg_bs64 170 python3 benchmarks/grammar_overlap.py --device cuda --batch 64 --steps 150 --algorithms ngram --overlap on --repeats 3 --grammar-backend llguidance
    run grammar_overlap_eagle 270 python3 benchmarks/grammar_overlap.py --device cuda --batch 1 8 32 64 --steps 60 --algorithms eagle --overlap on --repeats 2 --speculative-adaptive off ;;
  spin_ab)
    # the mask workers sleeping in recv between steps (spin 0) against polling for 20 ms
    # (the default on this host): EAGLE grammar overlap at batch 8 and 32, 1 repeat each
    for spin in 0 20; do
      export STRUCTSPEC_MASK_WORKER_SPIN_MS=$spin
      run grammar_overlap_eagle_spin$spin 130 python3 benchmarks/grammar_overlap.py --device cuda --batch 8 32 --steps 60 --algorithms eagle --overlap on --repeats 1 --speculative-adaptive off
    done
    unset STRUCTSPEC_MASK_WORKER_SPIN_MS ;;
  order_ab)
    run gpu_mask_worker_tests 200 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_mask_workers.py
    run grammar_overlap_eagle_order 380 python3 benchmarks/grammar_overlap.py --device cuda --batch 8 32 64 --steps 60 --algorithms eagle --overlap on --repeats 1 --speculative-adaptive off --walks-order after before ;;
  text_ab)
    # a device tree's text work while the tree is on its way or after it (one engine), then
    # the batch-1 row
    run grammar_overlap_eagle_text 400 python3 benchmarks/grammar_overlap.py --device cuda --batch ${TEXT_AB_BATCH:-8 32 64} --steps 60 --algorithms eagle --overlap on --speculative-adaptive off --text-while-drafting off on --repeats ${TEXT_AB_REPEATS:-2}
    run grammar_overlap_eagle_bs1 150 python3 benchmarks/grammar_overlap.py --device cuda --batch 1 --steps 60 --algorithms eagle --overlap on --repeats 3 --speculative-adaptive off ;;
  gates)
    # issue 18's EAGLE grammar overlap (batch 1 / 8 / 32 / 64) and issue 19's llguidance
    # batch-64 overlap, alternating repeats (odd, so the printed pair is the median): more and
    # shorter windows than one long one, as the host's own speed swings from one second to the
    # next (benchmarks/README.md, fifteenth H200 run; ~3.5 min on machine F)
    run grammar_overlap_eagle_gate 330 python3 benchmarks/grammar_overlap.py --device cuda --batch 1 8 32 64 --steps 40 --algorithms eagle --overlap on --repeats 9 --speculative-adaptive off
    run grammar_overlap_llg_gate 240 python3 benchmarks/grammar_overlap.py --device cuda --batch 64 --steps 100 --algorithms ngram --overlap on --repeats 7 --grammar-backend llguidance ;;
  new_gpu_tests)
    # the GPU tests a fresh machine's 200 s did not finish (2026-12-05: the batch-invariant
    # min_tokens / allowed_token_ids test was still compiling), after the Triton warm-up
    warm_triton
    run new_gpu_tests 400 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_engine.py -k "min_tokens_and_allowed" ;;
  inproc_ab)
    i=0
    for w in 0 8 0 8; do
      i=$((i + 1))
      run grammar_overlap_eagle_inproc_${i}_w$w 110 python3 benchmarks/grammar_overlap.py --device cuda --batch 8 32 --steps 40 --algorithms eagle --overlap on --repeats 3 --speculative-adaptive off --grammar-workers $w
    done ;;
  pool_host)
    run pool_host_cost 150 python3 benchmarks/pool_host_cost.py --batch 8 32 64 --workers 8 --spin-ms 20 --steps 400 ;;
  sampler)
    run sampler_cost 60 python3 benchmarks/sampler_cost.py --device cuda --rows 8 64 512 ;;
  mailbox_ab)
    # the spinning workers' jobs and replies through shared-memory mailboxes (the default)
    # against their sockets, processes alternating: EAGLE grammar overlap at batch 8 / 32 / 64
    i=0
    for mb in ${MAILBOX_AB:-1 0 1 0}; do
      i=$((i + 1))
      STRUCTSPEC_MASK_WORKER_MAILBOXES=$mb run grammar_overlap_eagle_${i}_mailbox$mb 120 python3 benchmarks/grammar_overlap.py --device cuda --batch 8 32 64 --steps 60 --algorithms eagle --overlap on --repeats 1 --speculative-adaptive off
    done ;;
  gate_ab)
    # the bitmask upload queued behind cuStreamWaitValue32 on the workers' flags (the default)
    # against the host waiting for their replies first, processes alternating
    i=0
    for g in ${GATE_AB:-1 0 1 0}; do
      i=$((i + 1))
      STRUCTSPEC_MASK_DEVICE_WAIT=$g run grammar_overlap_eagle_${i}_gate$g 130 python3 benchmarks/grammar_overlap.py --device cuda --batch 8 32 64 --steps 40 --algorithms eagle --overlap on --repeats 3 --speculative-adaptive off
    done ;;
  gate_tests)
    run gate_tests 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_mask_workers.py ;;
  workers_ab)
    # 8 mask workers (the default on 16 cores) against 12, processes alternating: the EAGLE
    # grammar overlap at batch 32 / 64, then llguidance ngram at batch 64 (~7 min)
    i=0
    for w in 8 12 8 12; do
      i=$((i + 1))
      run grammar_overlap_eagle_${i}_w$w 130 python3 benchmarks/grammar_overlap.py --device cuda --batch 32 64 --steps 60 --algorithms eagle --overlap on --repeats 1 --speculative-adaptive off --grammar-workers $w
    done
    for w in 8 12; do
      run grammar_overlap_llg_w$w 100 python3 benchmarks/grammar_overlap.py --device cuda --batch 64 --steps 150 --algorithms ngram --overlap on --repeats 1 --grammar-backend llguidance --grammar-workers $w
    done ;;
  host_step)
    run host_step_cost 200 python3 benchmarks/host_step_cost.py --algorithms none eagle --grammar --steps 300 ;;
  smol)
    run mask_build 60 python3 benchmarks/mask_build.py --batch 1 8 32 64 --threads 1 2 4 8 --reps 10
    run gpu_decode 60 python3 benchmarks/gpu_decode.py --skip-eager --skip-fold
    run grammar_overlap 450 python3 benchmarks/grammar_overlap.py --device cuda --batch 1 8 32 64 --steps 100 --algorithms ngram draft_model --repeats 2 ;;
  peer)
    run peer_compare 200 python3 benchmarks/peer_compare.py --device cuda --num-requests 8 ;;
  llama8b)
    run hbm_floor_8b 60 python3 benchmarks/hbm_floor.py --model $L8 --batch 1 8 32 64 --context 512
    run gpu_decode_8b 150 python3 benchmarks/gpu_decode.py --model $L8 --load-format dummy --nodes 1 8 --skip-fold --skip-eager
    STRUCTSPEC_GEMV=0 run gpu_decode_8b_cublas 90 python3 benchmarks/gpu_decode.py --model $L8 --load-format dummy --batch 1 --nodes 1 8 --skip-fold --skip-eager
    run gemv_micro 90 python3 benchmarks/kernels_micro.py --gemv ;;
  llama8b_overlap)
    run grammar_overlap_8b 560 python3 benchmarks/grammar_overlap.py --device cuda --model $L8 --load-format dummy --batch 1 8 32 64 --steps 100 --algorithms ngram draft_model --overlap on --repeats 2 --draft-model benchmarks/assets/llama3-1b-draft-shape ;;
  invariant)
    run gpu_decode_invariant 120 python3 benchmarks/gpu_decode.py --batch 1 8 32 64 --nodes 1 9 --skip-eager --skip-fold --floor-gib 0 --batch-invariant
    run gpu_decode_8b_invariant 200 python3 benchmarks/gpu_decode.py --model $L8 --load-format dummy --batch 1 8 32 64 --nodes 1 9 --skip-eager --skip-fold --floor-gib 0 --batch-invariant ;;
  maskbench)
    run maskbench 170 python3 benchmarks/maskbench_e2e.py --device cuda --speculative-algorithm ngram --limit 120 --max-tokens 1024 --skip-slow-compile --out "$OUT/maskbench.jsonl" ;;
  loopguards)
    MB="python3 benchmarks/maskbench_e2e.py --device cuda --speculative-algorithm ngram --limit 120 --max-tokens 512 --skip-slow-compile"
    run maskbench512_unbounded 150 $MB --unbounded-numbers --out "$OUT/mb512_unbounded.jsonl"
    run maskbench512_default 150 $MB --out "$OUT/mb512_default.jsonl"
    run maskbench512_freq03 150 $MB --frequency-penalty 0.3 --out "$OUT/mb512_freq03.jsonl"
    run maskbench512_freq06 150 $MB --frequency-penalty 0.6 --out "$OUT/mb512_freq06.jsonl" ;;
  loopguards2)
    MB="python3 benchmarks/maskbench_e2e.py --device cuda --speculative-algorithm ngram --limit 120 --max-tokens 512 --skip-slow-compile"
    run maskbench512_rep11 150 $MB --repetition-penalty 1.1 --out "$OUT/mb512_rep11.jsonl"
    run maskbench512_rep12 150 $MB --repetition-penalty 1.2 --out "$OUT/mb512_rep12.jsonl"
    run maskbench512_repeat_stop 150 $MB --stop-on-repeat --out "$OUT/mb512_repeat_stop.jsonl"
    run maskbench512_rep11_stop 150 $MB --repetition-penalty 1.1 --stop-on-repeat --out "$OUT/mb512_rep11_stop.jsonl" ;;
  penalty_cost)
    run penalty_cost 560 python3 benchmarks/penalty_cost.py --device cuda --batch 1 32 64 --steps 100 --repeats 2 ;;
  eagle_speed)
    run drafter_speed 300 python3 benchmarks/drafter_speed.py --device cuda --compact
    run grammar_overlap_eagle 420 python3 benchmarks/grammar_overlap.py --device cuda --batch 1 8 32 64 --steps 60 --algorithms eagle --overlap on --repeats 3 --speculative-adaptive off ;;
  eagle_speed2)
    run drafter_speed_fixed_trees 300 python3 benchmarks/drafter_speed.py --device cuda --algorithms none eagle --speculative-adaptive off --max-tokens 128 --batch1-prompts 4
    run grammar_overlap_eagle 200 python3 benchmarks/grammar_overlap.py --device cuda --batch 1 8 32 64 --steps 60 --algorithms eagle --overlap on --repeats 2 --speculative-adaptive off
    run profile_eagle 120 python3 benchmarks/profile_step.py --algorithm eagle --batch 1 --steps 300 --grammar --top 30
    run profile_none 100 python3 benchmarks/profile_step.py --algorithm none --batch 1 --steps 300 --grammar --top 30 ;;
  eagle_trace)
    run trace_eagle 150 python3 benchmarks/profile_step.py --algorithm eagle --batch 1 --steps 200 --grammar --trace --top 25
    run trace_none 100 python3 benchmarks/profile_step.py --algorithm none --batch 1 --steps 200 --grammar --trace --top 15 ;;
  serving_core)
    run gpu_prefill_graph_tests 90 python3 -m pytest -q -s -p no:cacheprovider tests/runner/test_prefill_graph.py
    run long_prompt_itl 150 python3 benchmarks/long_prompt_itl.py --device cuda --budgets 512 2048 --profile
    run priority_latency 110 python3 benchmarks/priority_latency.py --device cuda
    run gpu_serving_core_tests 220 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_serving_core.py ;;
  attn)
    run attention_tests 150 python3 -m pytest -q -s -p no:cacheprovider tests/kernels/test_attention.py
    run attention_causal 200 python3 benchmarks/attention_causal.py ;;
  itl)
    run long_prompt_itl 130 python3 benchmarks/long_prompt_itl.py --device cuda --budgets 512 256 --print-steps
    run long_prompt_itl_profiled 100 python3 benchmarks/long_prompt_itl.py --device cuda --budgets 512 --configs no_arrival chunked --profile
    run gpu_prefill_graph_tests 170 python3 -m pytest -q -s -p no:cacheprovider -o faulthandler_timeout=150 tests/runner/test_prefill_graph.py ;;
  mixed_tree_ngram)
    run gpu_mixed_tree_ngram 200 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_engine.py -k "mixed_tree_sizes and ngram" ;;
  eagle_prefill)
    run gpu_prefill_graph_tests 200 python3 -m pytest -q -s -p no:cacheprovider tests/runner/test_prefill_graph.py
    run gpu_serving_core_eagle 300 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_serving_core.py -k eagle ;;
  mixed_tree)
    run gpu_mixed_tree_tests 500 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_engine.py -k "mixed_tree_sizes or do_not_sync" ;;
  prefix_distinct)
    run prefix_cache 200 python3 benchmarks/prefix_cache.py --device cuda --num-requests 256 --max-batch-size 64 --system-tokens 2048 --max-tokens 64
    run distinct_schemas_ngram 420 python3 benchmarks/distinct_schemas.py --device cuda --prompt schema --num-requests 300 --max-batch-size 64 --max-tokens 512 --workers 0 8 --algorithms ngram --repeats 3 ;;
  llguidance)
    run llg_tokenizer_tests 150 python3 -m pytest -q -s -p no:cacheprovider tests/grammar/test_llg_tokenizer.py
    run tree_mask_cost 120 python3 benchmarks/tree_mask_cost.py --requests 64 --pool-workers 8
    run maskbench_auto 170 python3 benchmarks/maskbench_e2e.py --device cuda --speculative-algorithm ngram --limit 120 --max-tokens 1024 --skip-slow-compile --grammar-backend auto --out "$OUT/maskbench_auto.jsonl" ;;
  llguidance_overlap)
    run grammar_overlap_llg 450 python3 benchmarks/grammar_overlap.py --device cuda --batch 1 8 32 64 --steps 150 --algorithms ngram --overlap on --repeats 3 --grammar-backend llguidance ;;
  llguidance_bs8)
    run grammar_overlap_llg_bs8 300 python3 benchmarks/grammar_overlap.py --device cuda --batch 8 --steps 150 --algorithms ngram --overlap on --repeats 5 --grammar-backend llguidance ;;
  llguidance2)
    run grammar_ttft 240 python3 benchmarks/grammar_backends.py --ttft --device cuda --num-schemas 50
    run maskbench_auto_t06 170 python3 benchmarks/maskbench_e2e.py --device cuda --speculative-algorithm ngram --limit 120 --max-tokens 1024 --skip-slow-compile --grammar-backend auto --temperature 0.6 --top-p 0.95 --out "$OUT/maskbench_auto_t06.jsonl" ;;
  ab_overlap)
    run ab_overlap 560 python3 benchmarks/ab_compare.py --old "$OLD" --new . --rounds 2 -- benchmarks/grammar_overlap.py --device cuda --batch 1 32 64 --steps 100 --algorithms ngram --overlap on ;;
  ab_peer)
    run ab_peer 560 python3 benchmarks/ab_compare.py --old "$OLD" --new . --rounds 2 -- benchmarks/peer_compare.py --device cuda --num-requests 8 --skip-hf ;;
  *) echo "unknown stage $s"; unknown=1 ;;
esac; done
exit "${unknown:-0}"
