#!/usr/bin/env bash
# Reproduce the figures of benchmarks/RESULTS.md and of the notebook it grew from (benchmarks/log/) (needs root and iproute2 for the emulated
# cluster; without them `commfx bench` says so and runs on plain localhost).
# Usage: benchmarks/run_bench.sh [OUTDIR]   (default: a fresh temporary directory)
set -euo pipefail
cd "$(dirname "$0")/.."
COMMFX=${COMMFX:-.venv/bin/commfx}
OUT=${1:-$(mktemp -d -t commfx-bench-XXXXXX)}
mkdir -p "$OUT"
COMMON=(--nodes 2 --ranks-per-node 2 --steps 10 --warmup 2)

echo "# $(date -u +%F) $(nproc) cores; load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/machine.txt"

# 1. headline: expert parallel vs plain data parallel (the model's eager experts), with calibration
timeout 900 "$COMMFX" bench gpt-moe --passes lift,expert_parallel --vs "" "${COMMON[@]}" \
  --inter-node 200mbit,1ms --calibrate --json "$OUT/ep_vs_dp_200mbit.json" | tee "$OUT/ep_vs_dp_200mbit.txt"

# 2. same kernels on both sides: expert parallel vs data parallel over the lifted graph
for link in 200mbit,1ms 1gbit,1ms; do
  timeout 600 "$COMMFX" bench gpt-moe --passes lift,expert_parallel --vs lift "${COMMON[@]}" \
    --inter-node "$link" --json "$OUT/ep_vs_lift_${link%%,*}.json" | tee "$OUT/ep_vs_lift_${link%%,*}.txt"
done
# 3. Lina (section 4): naive expert parallel, chunking only, priority only and full Lina, interleaved
timeout 2400 "$COMMFX" bench gpt-moe --model-arg expert_hidden=1024 --grad-bucket-bytes 262144 \
  --flops-per-rank 2e10 --collective-overhead 5e-3 \
  --passes lift,expert_parallel,partition_a2a --vs lift,expert_parallel \
  --also "chunking=lift,expert_parallel,partition_a2a:k=2;priority=false" \
  --also "priority=lift,expert_parallel,partition_a2a:k=1" \
  --nodes 2 --ranks-per-node 2 --inter-node 100mbit --steps 8 --warmup 2 \
  --json "$OUT/lina_100mbit.json" --trace "$OUT/lina_traces" | tee "$OUT/lina_100mbit.txt"
# 5b. full Lina with expert packing (issue 10): a top-2 router trained 200 steps on the corpus
# (benchmarks/models/trained_router_moe.py caches it under out/), 2 nodes x 1 rank at 100 Mbit/s
timeout 2400 "$COMMFX" bench benchmarks/models/trained_router_moe.py:build --grad-bucket-bytes 262144 \
  --flops-per-rank 2e10 --collective-overhead 5e-3 \
  --passes "lift,expert_parallel,pack_experts:replace_every=2,partition_a2a" --vs lift,expert_parallel \
  --also "chunking=lift,expert_parallel,partition_a2a:k=2;priority=false" \
  --also "partition+priority=lift,expert_parallel,partition_a2a" \
  --also "packing only=lift,expert_parallel,pack_experts:replace_every=2" \
  --nodes 2 --ranks-per-node 1 --inter-node 100mbit --steps 8 --warmup 2 --timeout 2300 \
  --json "$OUT/lina_packed_100mbit_2x1.json" --trace "$OUT/lina_packed_traces" | tee "$OUT/lina_packed_100mbit_2x1.txt"
.venv/bin/python benchmarks/lina_packing_bytes.py "$OUT/lina_packed_100mbit_2x1.json" | tee "$OUT/lina_packing_bytes.txt"
# 4b. EmbRace: dense all-reduce vs split_embedding_comm (auto, sparse, shard), untied 50k vocabulary,
# word ids of pydoc_data.topics, 2 nodes x 1 rank at 100 Mbit/s; the built-in model and HF OLMoE
for model in gpt_moe_words olmoe_words; do
  timeout 1500 "$COMMFX" bench "benchmarks/embrace_models.py:$model" \
    --passes lift,expert_parallel,split_embedding_comm --vs lift,expert_parallel \
    --also "sparse=lift,expert_parallel,split_embedding_comm:strategy=sparse" \
    --also "shard=lift,expert_parallel,split_embedding_comm:strategy=shard" \
    --nodes 2 --ranks-per-node 1 --inter-node 100mbit --steps 10 --warmup 2 --timeout 1400 \
    --json "$OUT/embrace_${model}_100mbit.json" | tee "$OUT/embrace_${model}_100mbit.txt"
done
# Optimus-CC (issue 13): pp=2 on 2 nodes x 1 rank, 100 Mbit/s, hidden 1024; uncompressed vs rank 16 everywhere vs epilogue only
timeout 2400 "$COMMFX" bench gpt-moe --pp 2 --nodes 2 --ranks-per-node 1 --inter-node 100mbit \
  --passes "lift,pipeline_split:microbatches=2,compress_pipeline:rank=16;epilogue_only=false" \
  --vs "lift,pipeline_split:microbatches=2" \
  --also "epilogue only=lift,pipeline_split:microbatches=2,compress_pipeline:rank=16" \
  --steps 10 --warmup 1 --batch 64 --model-arg hidden_size=1024 --model-arg num_heads=8 \
  --model-arg num_experts=2 --model-arg top_k=1 --model-arg expert_hidden=16 \
  --json "$OUT/optimus_cc_100mbit.json" | tee "$OUT/optimus_cc_100mbit.txt"
# Bytes on the wire vs the scheduler's count, and the wire bound (issue 29, items 2-3):
# naive expert parallel vs full Lina on the built-in model, 2 nodes x 1 rank at 100 Mbit/s
timeout 900 "$COMMFX" bench gpt-moe --model-arg expert_hidden=1024 --grad-bucket-bytes 262144 \
  --flops-per-rank 2e10 --collective-overhead 5e-3 \
  --passes "lift,expert_parallel,pack_experts:replace_every=2,partition_a2a" --vs lift,expert_parallel \
  --nodes 2 --ranks-per-node 1 --inter-node 100mbit --steps 3 --warmup 1 --timeout 800 \
  --json "$OUT/wire_bytes_lina_gpt_moe_100mbit_2x1.json" | tee "$OUT/wire_bytes_lina_gpt_moe_100mbit_2x1.txt"
# RESULTS.md, Lina against DeepSpeed-MoE (issue 29): full Lina, naive expert parallel and
# peer:deepspeed_moe in one interleaved run (pip install 'commfx[peers]'), toy and Mixtral proportions
timeout 1500 "$COMMFX" bench gpt-moe --model-arg expert_hidden=1024 --inter-node 100mbit \
  --passes "lift,expert_parallel,pack_experts:replace_every=2,partition_a2a,microbatch_overlap,defer_grad_sync" --vs peer:deepspeed_moe \
  --also naive=lift,expert_parallel --nodes 2 --ranks-per-node 1 \
  --steps 5 --warmup 1 --steps-per-round 2 --timeout 1400 \
  --json "$OUT/peers_lina_gpt_moe_100mbit_2x1.json" | tee "$OUT/peers_lina_gpt_moe_100mbit_2x1.txt"
# At Mixtral-8x7B's proportions with the machine measured: no cost-model figure given, the link
# sized by --inter-node auto from the measured FLOP/s (issues 42 and 43)
timeout 1500 "$COMMFX" bench gpt-moe --proportions mixtral-8x7b --inter-node auto \
  --passes "lift,expert_parallel,pack_experts:replace_every=2,partition_a2a,microbatch_overlap,defer_grad_sync" --vs peer:deepspeed_moe \
  --also naive=lift,expert_parallel --nodes 2 --ranks-per-node 1 --steps 8 --warmup 1 --steps-per-round 2 --timeout 1400 \
  --json "$OUT/peers_lina_mixtral_proportions_2x1.json" | tee "$OUT/peers_lina_mixtral_proportions_2x1.txt"
# The same at Qwen3-30B-A3B's and OLMoE's proportions (128 and 64 experts, top-8)
for real in qwen3-30b-a3b olmoe-1b-7b; do
  name="peers_lina_${real//-/_}_proportions_2x1"
  timeout 1500 "$COMMFX" bench gpt-moe --proportions "$real" --inter-node auto \
    --passes "lift,expert_parallel,pack_experts:replace_every=2,partition_a2a,microbatch_overlap,defer_grad_sync" --vs peer:deepspeed_moe \
    --also naive=lift,expert_parallel --nodes 2 --ranks-per-node 1 --steps 8 --warmup 1 --steps-per-round 2 --timeout 1400 \
    --json "$OUT/$name.json" | tee "$OUT/$name.txt"
done
# RESULTS.md, EmbRace against DDP: the loss-returning words model (the LM head can be split)
timeout 1500 "$COMMFX" bench benchmarks/embrace_models.py:gpt_moe_words_loss --passes lift,expert_parallel,split_embedding_comm \
  --vs peer:ddp --also dense=lift,expert_parallel --nodes 2 --ranks-per-node 1 --inter-node 100mbit --steps 5 --warmup 1 \
  --timeout 1400 --json "$OUT/peers_embrace_gpt_moe_words_loss_100mbit_2x1.json" | tee "$OUT/peers_embrace_100mbit_2x1.txt"
# RESULTS.md, EmbRace against DDP on GPT-2 small's proportions (tied head, vocabulary / hidden 65.4, 12 layers)
timeout 1500 "$COMMFX" bench benchmarks/embrace_models.py:gpt2_words_loss --passes lift,split_embedding_comm \
  --vs peer:ddp --also dense=lift --nodes 2 --ranks-per-node 1 --inter-node 100mbit --steps 5 --warmup 1 \
  --timeout 1400 --json "$OUT/peers_embrace_gpt2_proportions_100mbit_2x1.json" | tee "$OUT/peers_embrace_gpt2_100mbit_2x1.txt"
# RESULTS.md, Optimus-CC against torch.distributed.pipelining: pp=2 on 2 nodes x 1 rank at 100 Mbit/s, the model
# of pipeline_quality_peer_model.json (hidden 256, byte vocabulary, 16 x 64 a step, 2 micro-batches)
timeout 1500 "$COMMFX" bench gpt-moe --pp 2 --nodes 2 --ranks-per-node 1 --inter-node 100mbit \
  --passes "lift,pipeline_split:microbatches=2,compress_pipeline" --vs peer:pipelining \
  --also "uncompressed=lift,pipeline_split:microbatches=2" \
  --also "rank 16 everywhere=lift,pipeline_split:microbatches=2,compress_pipeline:rank=16;epilogue_only=false" \
  --steps 8 --warmup 1 --batch 16 --model-arg hidden_size=256 --model-arg vocab_size=256 --timeout 1400 \
  --json "$OUT/peers_optimus_cc_pipelining_quiet_100mbit_2x1.json" | tee "$OUT/peers_optimus_cc_pipelining_quiet_100mbit_2x1.txt"
.venv/bin/python benchmarks/pipeline_quality.py --steps 300 --rank 16 --hidden 256 --expert-hidden 256 --batch 16 \
  --microbatches 2 --seeds 0,1,2 --json "$OUT/pipeline_quality_peer_model.json" | tee "$OUT/pipeline_quality_peer_model.txt"
# RESULTS.md, Optimus-CC at GPT-2.5B's proportions: dense, hidden 256, 4 layers in 2 stages, 4 micro-batches, the link
# sized so a stage's compute / its boundary send is that of Optimus-CC's A100 run; then its quality over 3 seeds
timeout 1500 "$COMMFX" bench gpt-moe --proportions gpt-2.5b --inter-node auto --pp 2 --nodes 2 --ranks-per-node 1 \
  --passes "lift,pipeline_split:microbatches=4,compress_pipeline" --vs peer:pipelining \
  --also "uncompressed=lift,pipeline_split:microbatches=4" \
  --also "rank 16 everywhere=lift,pipeline_split:microbatches=4,compress_pipeline:rank=16;epilogue_only=false" \
  --steps 8 --warmup 1 --batch 16 --timeout 1400 \
  --json "$OUT/peers_optimus_cc_gpt_2_5b_proportions_2x1.json" | tee "$OUT/peers_optimus_cc_gpt_2_5b_proportions_2x1.txt"
.venv/bin/python benchmarks/pipeline_quality.py --proportions gpt-2.5b --steps 300 --rank 16 --batch 16 --microbatches 4 \
  --seeds 0,1,2 --only "epilogue only, lazy error propagation" --only "compressed, no error feedback" \
  --json "$OUT/pipeline_quality_gpt_2_5b_proportions.json" | tee "$OUT/pipeline_quality_gpt_2_5b_proportions.txt"
# RESULTS.md, LocMoE like for like (issue 30): every router top-1, dropless and in capacity mode with LocMoE's floor,
# one interleaved run at 2 nodes x 1 rank, 100 Mbit/s, and one at 2 x 2, 1 Gbit/s (4 ranks on 2 cores)
LOCMOE=(--passes lift,locality_gate,expert_parallel --vs "lift,locality_gate:gate=switch;mu=0,expert_parallel"
  --also "hash=lift,locality_gate:gate=hash,expert_parallel" --also "grap=lift,locality_gate:gate=grap,expert_parallel"
  --also "model f0.3=lift,locality_gate:max_remote_fraction=0.3,expert_parallel"
  --also "model cap=lift,locality_gate,expert_parallel:capacity_factor=1.25"
  --also "switch cap=lift,locality_gate:gate=switch;mu=0,expert_parallel:capacity_factor=1.25"
  --also "hash cap=lift,locality_gate:gate=hash,expert_parallel:capacity_factor=1.25"
  --also "grap cap=lift,locality_gate:gate=grap,expert_parallel:capacity_factor=1.25")
for setup in "1 100mbit 2x1" "2 1gbit 2x2"; do
  read -r rpn link name <<<"$setup"
  timeout 1500 "$COMMFX" bench gpt-moe --model-arg top_k=1 "${LOCMOE[@]}" --nodes 2 --ranks-per-node "$rpn" \
    --inter-node "$link" --steps 7 --warmup 1 --timeout 1400 \
    --json "$OUT/locmoe_top1_${link}_${name}.json" | tee "$OUT/locmoe_top1_${link}_${name}.txt"
done
# its quality: 3 seeds x 300 steps on pydoc_data.topics bytes, 2 x 1; the built-in model and Qwen3-MoE proportions
for model in gpt-moe qwen3-moe; do
  extra=(); [ "$model" = gpt-moe ] && extra=(--plan "model+locality f0.3=lift,locality_gate:gate=model;max_remote_fraction=0.3,expert_parallel")
  only="model+locality f0.2,hash,grap+locality f0.2"; [ "$model" = gpt-moe ] && only="$only,model+locality f0.3"
  .venv/bin/python benchmarks/locmoe.py --model "$model" --seeds 0,1,2 --steps 300 \
    --plan "model+locality f0.2=lift,locality_gate:gate=model;max_remote_fraction=0.2,expert_parallel" \
    --plan "grap+locality f0.2=lift,locality_gate:gate=grap;max_remote_fraction=0.2,expert_parallel" "${extra[@]}" \
    --only "$only" --json "$OUT/locmoe_top1_quality_${model//-/_}.json" | tee "$OUT/locmoe_top1_quality_${model//-/_}.txt"
done
# RESULTS.md, LocMoE at Mixtral-8x7B's proportions and its own top-2: the locality gate against the model's router
# without locality and peer:deepspeed_moe, the link sized from this machine's measured rate (also Qwen3's and OLMoE's top-8)
for m in mixtral-8x7b qwen3-30b-a3b olmoe-1b-7b; do
  name=${m//-/_}; [ "$m" = mixtral-8x7b ] && name=mixtral
  timeout 1500 "$COMMFX" bench gpt-moe --proportions "$m" --inter-node auto --passes lift,locality_gate,expert_parallel \
    --vs peer:deepspeed_moe --also "no locality=lift,expert_parallel" --also "grap=lift,locality_gate:gate=grap,expert_parallel" \
    --nodes 2 --ranks-per-node 1 --steps 8 --steps-per-round 2 --timeout 1400 \
    --json "$OUT/locmoe_${name}_proportions_2x1.json" | tee "$OUT/locmoe_${name}_proportions_2x1.txt"
done
# its quality at Mixtral's top-2 and Qwen3's top-8: the defaults, then half the tokens off their node and the balance cap alone
for model in mixtral qwen3; do
  .venv/bin/python benchmarks/locmoe.py --model "$model" --seeds 0,1,2 --steps 300 \
    --json "$OUT/locmoe_quality_${model}_proportions.json" | tee "$OUT/locmoe_quality_${model}_proportions.txt"
  .venv/bin/python benchmarks/locmoe.py --model "$model" --seeds 0,1,2 --steps 300 \
    --plan "model+locality f0.5=lift,locality_gate:max_remote_fraction=0.5,expert_parallel" \
    --plan "balance only=lift,locality_gate:max_remote_fraction=1.0,expert_parallel" --only "model+locality f0.5,balance only" \
    --json "$OUT/locmoe_quality_${model}_f05.json" | tee "$OUT/locmoe_quality_${model}_f05.txt"
done
# RESULTS.md, ZeRO (issue 32): held bytes per rank at stage 3 vs replicated (dp 2 and 4), then each stage and
# peer:fsdp2 on an MoE and a dense gpt-moe, 2 nodes x 1 rank at 1 Gbit/s
for N in 2 4; do for P in lift lift,shard_states:stage=3 lift,expert_parallel lift,expert_parallel,shard_states:stage=3; do
  "$COMMFX" run gpt-moe --world-size $N --steps 2 --passes $P --json "$OUT/zero_memory_dp${N}_${P//[,:=]/_}.json"
done; done
timeout 900 "$COMMFX" bench gpt-moe --nodes 2 --ranks-per-node 1 --inter-node 1gbit --vs lift,expert_parallel \
  --passes lift,expert_parallel,shard_states:stage=3 --also z1=lift,expert_parallel,shard_states:stage=1 \
  --also z2=lift,expert_parallel,shard_states:stage=2 --also fsdp=peer:fsdp2 --steps 8 --warmup 2 \
  --json "$OUT/zero_gpt_moe_1gbit_2x1.json" | tee "$OUT/zero_gpt_moe_1gbit_2x1.txt"
timeout 900 "$COMMFX" bench gpt-moe --model-arg num_experts=1 --model-arg top_k=1 --nodes 2 --ranks-per-node 1 \
  --inter-node 1gbit --vs lift --passes lift,shard_states:stage=3 --also z1=lift,shard_states:stage=1 \
  --also z2=lift,shard_states:stage=2 --also fsdp=peer:fsdp2 --steps 8 --warmup 2 \
  --json "$OUT/zero_gpt_dense_1gbit_2x1.json" | tee "$OUT/zero_gpt_dense_1gbit_2x1.txt"
# RESULTS.md, mixed precision (issue 31): full Lina vs naive expert parallel in bf16 (and Lina with fp8
# dispatch) beside the same run in fp32, 2 nodes x 1 rank at 100 Mbit/s; fp8 vs bf16 dispatch quality, 3 seeds
for P in bf16 fp32; do
  extra=(); [ "$P" = bf16 ] && extra=(--also "lina fp8=lift,expert_parallel:dispatch=fp8,pack_experts:replace_every=2,partition_a2a")
  timeout 1200 "$COMMFX" bench gpt-moe --model-arg expert_hidden=1024 --grad-bucket-bytes 262144 \
    --flops-per-rank 2e10 --collective-overhead 5e-3 --precision $P \
    --passes "lift,expert_parallel,pack_experts:replace_every=2,partition_a2a" --vs lift,expert_parallel "${extra[@]}" \
    --nodes 2 --ranks-per-node 1 --inter-node 100mbit --steps 6 --warmup 1 --timeout 1100 \
    --json "$OUT/mixed_precision_lina_${P}_quiet_100mbit_2x1.json" | tee "$OUT/mixed_precision_lina_${P}_quiet_100mbit_2x1.txt"
done
nice -n 10 timeout 2400 .venv/bin/python benchmarks/fp8_dispatch_quality.py --seeds 0,1,2 --steps 300 \
  --json "$OUT/fp8_dispatch_quality.json" | tee "$OUT/fp8_dispatch_quality.txt"
echo "results in $OUT"
# EmbRace's 2D scheduling (issue 44): schedule=2d against schedule=step and DDP on an untied
# 50k-word Llama (embeddings and head 84% of the parameters), a stream of Zipf batches
timeout 1800 "$COMMFX" bench benchmarks/embrace_models.py:llama_words_loss \
  --passes "lift,split_embedding_comm:schedule=2d" --vs peer:ddp --also "step=lift,split_embedding_comm" \
  --nodes 2 --ranks-per-node 1 --inter-node 100mbit --steps 6 --warmup 1 --timeout 1700 \
  --json "$OUT/embrace_2d_llama_words_100mbit_2x1.json" --trace "$OUT/embrace_2d_traces" | tee "$OUT/embrace_2d_llama_words_100mbit_2x1.txt"
# ZeRO-3 against FSDP2 (results page, ZeRO row): a dense gpt-moe (one expert) with many buckets,
# 2 nodes x 1 rank at 1 Gbit/s
timeout 1500 "$COMMFX" bench gpt-moe --passes "lift,shard_states:stage=3;bucket_bytes=auto" --vs lift --also fsdp=peer:fsdp2 \
  --model-arg num_layers=4 --model-arg hidden_size=256 --model-arg num_experts=1 --model-arg top_k=1 --model-arg expert_hidden=1024 \
  --batch 16 --nodes 2 --ranks-per-node 1 --inter-node 1gbit --steps 8 --warmup 2 --timeout 1400 \
  --json "$OUT/zero3_dense_buckets_1gbit_2x1.json" | tee "$OUT/zero3_dense_buckets_1gbit_2x1.txt"
# SEMI (resize_tp) against DTensor tensor parallelism with the same half-speed rank 1 (a CPU quota of half a
# core, which slows a peer too), and both healthy (results page, SEMI row), 2 x 1 with no link limit
timeout 1500 "$COMMFX" bench hf:llama --tp 2 --passes lift,tensor_parallel,resize_tp --vs peer:dtensor_tp \
  --also healthy-tp=lift,tensor_parallel --also healthy-dtensor=peer:dtensor_tp --healthy healthy-tp --healthy healthy-dtensor \
  --slow-rank 1:2 --slow-method cgroup \
  --model-arg hidden_size=256 --model-arg intermediate_size=1024 --model-arg num_attention_heads=4 --model-arg num_key_value_heads=4 \
  --batch 8 --nodes 2 --ranks-per-node 1 --inter-node none --steps 20 --warmup 6 --timeout 800 \
  --json "$OUT/peers_semi_dtensor_tp_llama_2x1.json" | tee "$OUT/peers_semi_dtensor_tp_llama_2x1.txt"
# LocMoE (results page, LocMoE row): the locality gate against switch, hash and GrAP routers, all
# top-1, dropless and at capacity 1.25, 2 nodes x 1 rank at 100 Mbit/s
timeout 1500 "$COMMFX" bench gpt-moe --model-arg top_k=1 --passes lift,locality_gate,expert_parallel --vs "lift,locality_gate:gate=switch;mu=0,expert_parallel" \
  --also "hash=lift,locality_gate:gate=hash,expert_parallel" --also "grap=lift,locality_gate:gate=grap,expert_parallel" \
  --also "model f0.3=lift,locality_gate:max_remote_fraction=0.3,expert_parallel" --also "model cap=lift,locality_gate,expert_parallel:capacity_factor=1.25" \
  --also "switch cap=lift,locality_gate:gate=switch;mu=0,expert_parallel:capacity_factor=1.25" --also "hash cap=lift,locality_gate:gate=hash,expert_parallel:capacity_factor=1.25" \
  --also "grap cap=lift,locality_gate:gate=grap,expert_parallel:capacity_factor=1.25" \
  --nodes 2 --ranks-per-node 1 --inter-node 100mbit --steps 7 --warmup 1 --timeout 1400 \
  --json "$OUT/locmoe_top1_100mbit_2x1.json" | tee "$OUT/locmoe_top1_100mbit_2x1.txt"
