"""commfx.distribute's step and peak memory on one GPU under activation_memory_budget."""
import dataclasses, os, sys, time
budgets = [float(b) for b in sys.argv[1:]]
sys.argv = [sys.argv[0]]
exec(open(os.path.join(os.path.dirname(__file__), "gpu_e2e.py")).read().split("if __name__")[0])
STEPS = 4
dist.init_process_group("cpu:gloo,cuda:nccl"); torch.cuda.set_device(0)
ids = torch.randint(0, 32000, (B, S), generator=torch.Generator().manual_seed(1)).cuda()
for budget in budgets:
    t0 = time.perf_counter()
    m = build()
    plan = dataclasses.replace(commfx.Plan.from_cli("lift,expert_parallel", world_size=1), precision="bf16", activation_memory_budget=budget)
    dm = commfx.distribute(m, plan, {"input_ids": ids, "labels": ids})
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-4)
    def step():
        opt.zero_grad(set_to_none=True)
        l = dm(input_ids=ids, labels=ids).loss
        l.backward(); opt.step(); return l
    r = timed(step)
    print("budget", budget, {k: round(v, 2) for k, v in r.items()}, "wall_s", round(time.perf_counter() - t0, 1), flush=True)
    del m, dm, opt; torch.cuda.empty_cache()
