#!/usr/bin/env python3
# Splits a perf profile of the CPU engine by op: each sample of the step (engine thread + thread pool)
# goes to the category of its innermost frame that matches one (issue #22's "where the time goes").
#   perf record -e cpu-clock -F 999 --call-graph dwarf,8192 -p $(pidof kestrel) -o prof.data -- sleep 10
#   perf script -i prof.data | python3 bench/cpu_profile_categories.py [-v]
# (cpu-clock: this VM has no hardware counters; dwarf: the build has no frame pointers.) -v also lists
# the innermost frames of what fell into no category.
import sys, re, collections
CATS = [  # (category, regex on a frame), checked innermost frame first
  ("gemm bf16 (panels)", r"panels_avx2|panels_portable|panels_avx512|gemm_detail::pack"),
  ("moe experts mxfp4", r"mxfp4_rows|block_avx2|direct_avx2|tile<|decode_row|moe_experts"),
  ("situ_glu", r"situ_glu"),
  ("kda scan", r"kda_scan|scan_avx2|scan_chunk"),
  ("kda other (conv, norms, gates)", r"conv_avx2|kda_conv|gates_avx2|kda_qk_norm|out_norm|kda_out_norm"),
  ("mla attention", r"mla_attn|mla_q_latent|mla_o_latent|logits_avx2|values_chunk|combine_avx2|one_pair|gather_rows|read_latent|scores_n<"),
  ("indexer", r"indexer|topk_sorted|scores_avx2|scores_scalar"),
  ("attn_res mix", r"attn_res"),
  ("rmsnorm", r"rmsnorm"),
  ("moe route / add / misc elementwise", r"moe_route|add_bf16|sigmoid_gate|topk"),
  ("sampling", r"sample_token|Sampler|sampler"),
  ("page faults / memset / alloc", r"page_fault|memset|clear_page|_int_malloc|_int_free|malloc|munmap|mmap"),
  ("thread pool (spin/wake/wait)", r"Pool::|wait_change|futex|sched_yield|schedule"),
]
fwd = collections.Counter(); total = 0; step = 0; other = collections.Counter()
stack = []
def flush():
    global total, step
    if not stack: return
    total += 1
    frames = stack[:]  # innermost first
    in_step = any(re.search(r"Executor::run_rank|Engine::run_step|Pool::start_workers", f) for f in frames)
    if not in_step: return
    step += 1
    for f in frames:
        for name, rx in CATS:
            if re.search(rx, f):
                fwd[name] += 1; return
    other[frames[0][:80]] += 1; fwd["other"] += 1
for line in sys.stdin:
    line = line.rstrip("\n")
    if not line.strip():
        flush(); stack = []; continue
    if line.startswith(("\t", " ")):
        parts = line.strip().split(None, 1)
        if len(parts) == 2: stack.append(parts[1])
    else:
        flush(); stack = []
flush()
print(f"samples {total}, in the step (engine + pool threads) {step}")
for k, v in fwd.most_common(): print(f"  {100.0 * v / max(step, 1):5.1f}%  {k}")
if "-v" in sys.argv:
    for k, v in other.most_common(15): print("   other:", v, k)
