"""First compiled training step of gpt-moe at world 1 against its depth, with an empty Inductor
cache (2026-12-03 notebook entry): lowering, the region compiles, one forward and backward,
as tests/test_compiled_regions.py's `_train_once(..., "inductor")` runs them; and how many
regions were traced with make_fx. Each depth runs in a fresh process with a fresh
`TORCHINDUCTOR_CACHE_DIR`.
Run: .venv/bin/python benchmarks/log/2026-12-03-region_compile_time.py [LAYERS ...]"""
import os
import subprocess
import sys
import tempfile
import time


def one(layers: int) -> None:
    import torch
    import torch.fx.experimental.proxy_tensor as proxy_tensor

    sys.path.insert(0, "tests")
    from test_compiled_regions import LINA, _train_once

    from commfx.compiler.pipeline import compile_program
    from commfx.compiler.sharding import shard_parameters
    from commfx.models import load_model
    from commfx.plan import Plan

    traced = [0]
    make_fx = proxy_tensor.make_fx

    def counting(*args, **kwargs):
        traced[0] += 1
        return make_fx(*args, **kwargs)

    proxy_tensor.make_fx = counting
    model, inputs = load_model("gpt-moe", seed=0, num_layers=layers)
    program = compile_program(model, Plan.from_cli(LINA, world_size=1), inputs)
    shard_parameters(program, 0)
    start = time.perf_counter()
    _train_once(program.gm, inputs, "inductor")
    print(f"{layers} layers: first compiled step {time.perf_counter() - start:.1f} s, {traced[0]} make_fx traces "
          f"(torch {torch.__version__})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one(int(sys.argv[2]))
    else:
        for layers in map(int, sys.argv[1:] or ["2", "6"]):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": "src"}
                subprocess.run([sys.executable, __file__, "--one", str(layers)], env=env, check=True)
