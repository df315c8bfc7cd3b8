"""Project plans onto a GPU cluster without the cluster: `commfx simulate` from Python.

Compiles each plan for one rank of 2 nodes x 8 H100s (experts over the 8 GPUs of a node,
replicated over the 2 nodes) and simulates one training step (roofline compute, link
model, the runtime's priority lanes), then prints the predicted step and how much
communication stayed exposed. Run: python examples/simulate_plan.py
"""

from commfx import Plan
from commfx.simulate import load_cluster, simulate

cluster = load_cluster("h100").with_layout(nodes=2)  # or a TOML file of your own
for passes in ("lift,expert_parallel", "lift,expert_parallel,partition_a2a"):
    plan = Plan.from_cli(passes, world_size=cluster.world_size, ranks_per_node=cluster.ranks_per_node, ep=8)
    prediction = simulate("gpt-moe", plan, cluster, batch=64, model_kwargs={"num_layers": 1})
    result = prediction.result
    print(f"{passes}: step {result.step_s * 1e3:.3f} ms, exposed communication {result.exposed_comm_s * 1e3:.3f} ms")
