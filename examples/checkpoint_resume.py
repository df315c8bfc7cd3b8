"""Save, resume and export a commfx run from your own torchrun script.

    torchrun --standalone --nproc_per_node 2 examples/checkpoint_resume.py --steps 4 --checkpoint-dir ck
    torchrun --standalone --nproc_per_node 2 examples/checkpoint_resume.py --steps 6 --checkpoint-dir ck --resume --export hf
    torchrun --standalone --nproc_per_node 2 examples/checkpoint_resume.py --passes lift,expert_parallel,shard_states:stage=3

Every rank calls `commfx.save` together: each tensor is written under its name in the model
(experts by expert, whatever rank holds them), so the checkpoint also resumes on another
number of ranks. `commfx.load` restores the model, the optimizer and commfx's runtime state
(expert placements, step counters). `commfx.export_hf` writes the whole trained model for
`transformers`' `from_pretrained`. With `shard_states` in the plan (ZeRO), `commfx.shard_optimizer`
steps only this rank's shard of each parameter's state; without it, it is a plain AdamW.
"""

import argparse
import os

import torch
import torch.distributed as dist
from transformers import MixtralConfig, MixtralForCausalLM

import commfx


def build_model() -> MixtralForCausalLM:
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )
    return MixtralForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--passes", default="lift,expert_parallel,partition_a2a")
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--resume", action="store_true", help="start from the latest checkpoint in --checkpoint-dir")
    parser.add_argument("--export", help="write the trained model here for from_pretrained")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.arange(4 * 16).remainder(256).view(4, 16).roll(rank)  # this rank's batch
    plan = commfx.Plan.from_cli(args.passes, world_size=world)  # e.g. lift,expert_parallel,shard_states:stage=3
    dm = commfx.distribute(build_model(), plan, {"input_ids": ids, "labels": ids})
    optimizer = commfx.shard_optimizer(dm, torch.optim.AdamW, lr=3e-3)  # a plain AdamW when the plan does not shard
    dm.attach_optimizer(optimizer)

    start = 0
    if args.resume:
        start = commfx.load(dm, optimizer, args.checkpoint_dir)["step"]
    for step in range(start, args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = dm(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {loss.item():.4f}", flush=True)
        if (step + 1) % 2 == 0:
            commfx.save(dm, optimizer, args.checkpoint_dir, step=step + 1)
    if args.export:
        commfx.export_hf(dm, args.export)
    if rank == 0:
        print(f"saved {sorted(os.listdir(args.checkpoint_dir))}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
