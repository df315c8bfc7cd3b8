"""Train a Hugging Face MoE model with expert parallelism from your own torchrun script.

    torchrun --standalone --nproc_per_node 2 examples/train_hf_moe.py --steps 5

The model is exactly what transformers returns (no wrapper, no config edits). commfx
captures it, shards its experts over the ranks, chunks the all-to-alls (Lina), and hands back
a module that is called like the original and returns what it returns: HF computes its own
loss from `labels=`. Tokens are bytes of Python's own documentation (pydoc_data.topics).
"""

import argparse
import pydoc_data.topics

import torch
import torch.distributed as dist
from transformers import MixtralConfig, MixtralForCausalLM

import commfx


def batches(rank: int, world: int, batch: int, seq: int):
    """Each rank's slice of consecutive byte sequences of the corpus."""
    text = "".join(pydoc_data.topics.topics.values()).encode("utf-8", "replace")
    data = torch.tensor(list(text), dtype=torch.long)
    step = 0
    while True:
        start = (step * world + rank) * batch * seq
        yield data[start : start + batch * seq].view(batch, seq)
        step += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--passes", default="lift,expert_parallel,partition_a2a:k=2")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    config = MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
    )
    model = MixtralForCausalLM(config)  # as transformers returns it

    plan = commfx.Plan.from_cli(args.passes, world_size=world)
    data = batches(rank, world, batch=4, seq=32)
    ids = next(data)
    dm = commfx.distribute(model, plan, {"input_ids": ids, "labels": ids})
    optimizer = torch.optim.AdamW(dm.parameters(), lr=3e-3)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        out = dm(input_ids=ids, labels=ids)  # a MoeCausalLMOutputWithPast, as the model returns
        out.loss.backward()  # gradients are synchronised during backward
        optimizer.step()
        losses = [None] * world
        dist.all_gather_object(losses, out.loss.item())
        if rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {sum(losses) / world:.4f}", flush=True)
        ids = next(data)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
