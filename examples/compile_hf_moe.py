"""torch.compile with the commfx backend, on a Hugging Face MoE model as transformers returns it.

    torchrun --standalone --nproc_per_node 2 examples/compile_hf_moe.py --steps 3

dynamo may hand the backend several graphs (HF's mask and loss code can break the graph);
graphs with an MoE block get the plan's passes, the rest run unchanged, and every graph's
gradients are synchronised during backward. The user keeps full-size parameters (experts
are sliced in the graph); `commfx.distribute` is the door that really shards memory.
"""

import argparse

import torch
import torch.distributed as dist
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import commfx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=64,
    )
    model = Qwen3MoeForCausalLM(config)
    plan = commfx.Plan.from_cli("lift,expert_parallel", world_size=world)
    compiled = torch.compile(model, backend=commfx.backend(plan, model=model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, config.vocab_size, (4, 16), generator=generator)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
