"""Per-step losses over 12 AdamW steps, same weights and batch: eager vs commfx (inductor and
interpret), in float32 and in bf16 (eager under autocast, commfx Plan(precision="bf16")).
Says whether the bf16 drift after 9 steps is rounding or a defect: float32 must agree."""
import dataclasses, json, os, sys
sys.argv = [sys.argv[0]]
os.environ.setdefault("E2E_BATCH", "4"); os.environ.setdefault("E2E_SEQ", "512")
exec(open(os.path.join(os.path.dirname(__file__), "gpu_e2e.py")).read().split("if __name__")[0])
dist.init_process_group("cpu:gloo,cuda:nccl"); torch.cuda.set_device(0)
ids = torch.randint(0, 32000, (B, S), generator=torch.Generator().manual_seed(1)).cuda()
STEPS_N = 12
def run(kind, precision):
    model = build()
    if kind == "eager":
        fwd, params = model, model.parameters()
    else:
        plan = dataclasses.replace(commfx.Plan.from_cli("lift,expert_parallel", world_size=1), precision=precision, compute=kind)
        fwd = commfx.distribute(model, plan, {"input_ids": ids, "labels": ids}); params = fwd.parameters()
    opt = torch.optim.AdamW(params, lr=1e-4)
    losses = []
    for _ in range(STEPS_N):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16, enabled=(kind == "eager" and precision == "bf16")):
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); losses.append(round(loss.item(), 5))
    return losses
out = {}
for precision, kinds in (("fp32", ("eager", "inductor")), ("bf16", ("eager", "inductor", "interpret"))):
    for kind in kinds:
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            out[f"{kind} {precision}"] = run(kind, precision)
        except Exception as e:
            out[f"{kind} {precision}"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"{kind} {precision}", out[f"{kind} {precision}"], flush=True)
        torch.cuda.empty_cache()
print(json.dumps(out))
