#!/usr/bin/env bash
# The seeds' headlines projected onto the a100 preset (RESULTS.md, "Projections onto GPU
# clusters"). Each `commfx plan --candidate ...` prints its ranked table; OUT gets the logs.
# About 10 minutes on 2 cores; the Optimus-CC run holds about 20 GB while it traces.
set -euo pipefail
COMMFX=${COMMFX:-.venv/bin/commfx}
OUT=${1:-benchmarks/log}
mkdir -p "$OUT"
# Lina's, LocMoE's and EmbRace's model: GPT-2-medium widths, 2 MoE layers, 2,048 tokens a GPU
M="--model-arg num_layers=2 --model-arg hidden_size=1024 --model-arg num_heads=16 --model-arg expert_hidden=4096 \
   --model-arg vocab_size=50257 --model-arg max_seq=16 --model-arg seq=16 --rows-per-rank 128"
for precision in bf16 fp32; do
  for world in 16 32; do
    $COMMFX plan gpt-moe --cluster a100 --world $world $M --precision $precision --model-arg top_k=2 --model-arg num_experts=$world \
      --candidate lift,expert_parallel --candidate lift,expert_parallel,partition_a2a \
      --candidate lift,expert_parallel,pack_experts,partition_a2a --candidate lift,expert_parallel,partition_a2a:k=4 \
      --candidate lift,expert_parallel,split_embedding_comm | tee "$OUT/projection_lina_embrace_a100_${world}_${precision}.txt"
  done
done
$COMMFX plan gpt-moe --cluster a100 --world 64 $M --precision bf16 --model-arg top_k=1 --model-arg num_experts=64 \
  --candidate "lift,locality_gate:gate=switch;mu=0,expert_parallel" --candidate lift,locality_gate,expert_parallel \
  | tee "$OUT/projection_locmoe_a100_64_bf16.txt"
# Optimus-CC's GPT-2.5B (its artifact's scripts: 52 layers, hidden 1920, 24 heads, tp 8 x pp 4,
# micro-batch 8 x 1,024 tokens, global batch 512) on 16 nodes; a Llama block with the MLP's
# FLOPs of GPT's (3 x 5120 = 2 x 7680), traced one token a row, 131,072 tokens a data-parallel rank
G="--model-arg num_hidden_layers=52 --model-arg hidden_size=1920 --model-arg num_attention_heads=24 \
   --model-arg num_key_value_heads=24 --model-arg intermediate_size=5120 --model-arg vocab_size=50257 \
   --model-arg tie_word_embeddings=true --model-arg seq=1 --rows-per-rank 131072 --precision bf16 --pp 4 --tp 8"
P=lift,tensor_parallel,pipeline_split:microbatches=16
$COMMFX plan hf:llama --cluster a100 --world 128 $G --memory-limit 1TB \
  --candidate $P --candidate "$P,compress_pipeline:rank=16;fuse_embedding_sync=false" --candidate "$P,compress_pipeline:rank=16" \
  --candidate "$P,compress_pipeline:rank=16;dp_stages=3;dp_rank=128" | tee "$OUT/projection_optimus_cc_a100_128_bf16.txt"
