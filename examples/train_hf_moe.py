"""Train a Hugging Face MoE model with expert parallelism from your own torchrun script.

    torchrun --standalone --nproc_per_node 2 examples/train_hf_moe.py --steps 5

On several machines the plan's nodes are torchrun's (--nnodes, --nproc-per-node), so
`locality_gate` and `hierarchical_a2a` plan for the real machine (README, "Several machines").

The model is exactly what transformers returns (no wrapper, no config edits). commfx
captures it, shards its experts over the ranks, chunks the all-to-alls (Lina), and hands back
a module that is called like the original and returns what it returns: HF computes its own
loss from `labels=`. Tokens are bytes of Python's own documentation (pydoc_data.topics).
"""

import argparse
import json
import math
import os
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


def build_model() -> MixtralForCausalLM:
    """A small Mixtral, the same initial weights on every rank."""
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
    )
    model = MixtralForCausalLM(config)  # as transformers returns it
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--passes", default="lift,expert_parallel,partition_a2a:k=2")
    parser.add_argument("--report", help="JSON file (rank 0): topology, losses, gate ops, rows kept on node")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()

    plan = commfx.Plan.from_cli(args.passes, world_size=world)
    data = batches(rank, world, batch=4, seq=32)
    ids = next(data)
    dm = commfx.distribute(model, plan, {"input_ids": ids, "labels": ids})
    nodes, per_node = world // plan.topology.node_size, plan.topology.node_size
    if rank == 0:
        print(f"topology: world={world} nodes={nodes} ranks_per_node={per_node}", flush=True)
    if args.report:
        dm.scheduler.records = []  # every collective's rows per peer, for the report
    history = []
    optimizer = torch.optim.AdamW(dm.parameters(), lr=3e-3)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        out = dm(input_ids=ids, labels=ids)  # a MoeCausalLMOutputWithPast, as the model returns
        out.loss.backward()  # gradients are synchronised during backward
        optimizer.step()
        losses = [None] * world
        dist.all_gather_object(losses, out.loss.item())
        history.append(sum(losses) / world)
        if rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {history[-1]:.4f}", flush=True)
        ids = next(data)
    if args.report:
        report(dm, args.report, history)
    dist.destroy_process_group()


def report(dm, path: str, history: list[float]) -> None:
    """Rank 0 writes what every rank planned with and where the expert all-to-alls' rows went."""
    topology, rank = dm.plan.topology, dist.get_rank()
    ep = dm.scheduler.group("ep").ranks
    on_node = off_node = 0
    for record in dm.scheduler.records:  # flat rows per destination, whichever algorithm ran
        if record.kind == "all_to_all" and record.group == "ep" and record.row_shape:  # rows, not counts
            for index, rows in enumerate(record.send_rows):
                if topology.node_of(ep[index]) == topology.node_of(rank):
                    on_node += rows
                else:
                    off_node += rows
    gate = torch.ops.commfx.locality_topk.default
    mine = {
        "rank": rank, "ranks_per_node": topology.ranks_per_node, "node": topology.node_of(rank),
        "torchrun_node": int(os.environ.get("GROUP_RANK", -1)), "rows_on_node": on_node, "rows_off_node": off_node,
        "locality_gates": sum(node.target is gate for node in dm.module.graph.nodes),
        "a2a_algorithm": dm.program.runtime.a2a_algorithm, "bytes": dm.comm_stats.as_dict(),
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        summary = {"world": len(ranks), "nodes": len(ranks) // topology.node_size, "ranks_per_node": topology.node_size,
                   "losses": history, "finite": all(map(math.isfinite, history)), "ranks": ranks}
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
        sent = sum(r["rows_on_node"] + r["rows_off_node"] for r in ranks)
        print(f"expert all-to-all rows off their node: {sum(r['rows_off_node'] for r in ranks) / max(sent, 1):.0%}", flush=True)


if __name__ == "__main__":
    main()
