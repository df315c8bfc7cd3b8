"""Train with pipeline parallelism, and Optimus-CC's compressed backward traffic, from your
own torchrun script.

    torchrun --standalone --nproc_per_node 2 examples/train_pipeline.py --steps 5
    torchrun --standalone --nproc_per_node 2 examples/train_pipeline.py --passes lift,pipeline_split,compress_pipeline:rank=4

Each rank holds one stage (here pp=2: embeddings and layer 0, then layer 1 and the head);
with more ranks than stages the rest is data parallel (rank = stage * dp + replica). A
pipeline runs forward and backward together over micro-batches, so the module is driven by
`step(inputs, loss_fn=...)` instead of a call and `loss.backward()`. Tokens are bytes of
Python's own documentation (pydoc_data.topics).
"""

import argparse
import pydoc_data.topics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commfx
from commfx.models import build_gpt_moe


def batches(replica: int, replicas: int, batch: int, seq: int):
    """Each data-parallel replica's slice of consecutive byte sequences of the corpus."""
    text = "".join(pydoc_data.topics.topics.values()).encode("utf-8", "replace")
    data = torch.tensor(list(text), dtype=torch.long)
    step = 0
    while True:
        start = (step * replicas + replica) * batch * seq
        yield data[start : start + batch * seq].view(batch, seq)
        step += 1


def next_token_loss(logits, microbatch):
    ids = microbatch.inputs[0]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--passes", default="lift,pipeline_split:schedule=1f1b;microbatches=4")
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model, _ = build_gpt_moe(vocab_size=256, hidden_size=64, num_layers=2, max_seq=64, seed=0)
    plan = commfx.Plan.from_cli(args.passes, world_size=world, pp=args.pp)
    stage, replica, _ = plan.topology.coordinates(dist.get_rank())
    data = batches(replica, plan.topology.dp, batch=8, seq=32)
    ids = next(data)
    dm = commfx.distribute(model, plan, (ids,))
    optimizer = torch.optim.AdamW(dm.parameters(), lr=3e-3)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        result = dm.step(ids, loss_fn=next_token_loss)  # forward + backward of every micro-batch
        optimizer.step()
        if result.loss is not None:  # the last stage has the loss
            print(f"step {step + 1} loss {result.loss.item():.4f}", flush=True)
        ids = next(data)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
