"""Step-0 loss and gradient norm: eager under autocast vs commfx.distribute(precision=bf16), same weights;
then commfx's step time with compute=interpret (the old executor) against inductor."""
import dataclasses, os, sys, time
sys.argv = [sys.argv[0]]
exec(open(os.path.join(os.path.dirname(__file__), "gpu_e2e.py")).read().split("if __name__")[0])
dist.init_process_group("cpu:gloo,cuda:nccl"); torch.cuda.set_device(0)
ids = torch.randint(0, 32000, (B, S), generator=torch.Generator().manual_seed(1)).cuda()
model = build()
with torch.autocast("cuda", torch.bfloat16):
    ref = model(input_ids=ids, labels=ids).loss
ref.backward()
ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None])).item()
print("eager autocast step-0 loss", ref.item(), "grad norm", ref_norm, flush=True)
for compute in ("inductor", "interpret"):
    m = build()
    plan = dataclasses.replace(commfx.Plan.from_cli("lift,expert_parallel", world_size=1), precision="bf16", compute=compute)
    dm = commfx.distribute(m, plan, {"input_ids": ids, "labels": ids})
    loss = dm(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in dm.parameters() if p.grad is not None])).item()
    print(compute, "commfx step-0 loss", loss.item(), "grad norm", norm, "param dtypes", sorted({str(p.dtype) for p in dm.parameters()}), flush=True)
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-4)
    def step():
        opt.zero_grad(set_to_none=True)
        l = dm(input_ids=ids, labels=ids).loss
        l.backward(); opt.step(); return l
    r = timed(step)
    print(compute, r, flush=True)
    del m, dm, opt; torch.cuda.empty_cache()
