"""Bytes each rank holds after a ZeRO step: parameters, gradients and AdamW state, stage 3
against the replicated plan, with and without expert parallelism, at dp 2 and 4.

Runs `commfx run gpt-moe --world-size N --steps 2 --passes PLAN --json F` for each plan and
world (ranks on this machine's cores; the bytes do not depend on speed) and writes rank 0's
figures and every rank's, with the run record. Run: `python benchmarks/zero_memory.py
--json benchmarks/zero_memory_gpt_moe.json` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from commfx.bench.run_record import TOY, RunRecorder

PLANS = ("lift", "lift,shard_states:stage=3", "lift,expert_parallel", "lift,expert_parallel,shard_states:stage=3")
WORLDS = (2, 4)
RUN_TIMEOUT_S = 600


def held_bytes(world: int, passes: str, scratch: Path) -> list[dict]:
    """Each rank's held bytes after a 2-step `commfx run` of gpt-moe."""
    out = scratch / f"dp{world}_{passes.replace(',', '_').replace(':', '_').replace('=', '_')}.json"
    command = [sys.executable, "-m", "commfx", "run", "gpt-moe", "--world-size", str(world), "--steps", "2",
               "--passes", passes, "--json", str(out)]
    subprocess.run(command, check=True, timeout=RUN_TIMEOUT_S, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["memory"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the figures here")
    args = parser.parse_args()
    recorder = RunRecorder(proportions=TOY)
    per_rank = {}
    with tempfile.TemporaryDirectory() as scratch:
        for world in WORLDS:
            for passes in PLANS:
                key = f"dp={world} {passes}"
                per_rank[key] = held_bytes(world, passes, Path(scratch))
                print(f"{key}: rank 0 holds {per_rank[key][0]['total']:,} bytes", flush=True)
    record = {
        "command": "commfx run gpt-moe --world-size N --steps 2 --passes PLAN --json F",
        "memory_rank0": {key: ranks[0] for key, ranks in per_rank.items()},
        "per_rank": per_rank,
        "run": recorder.finish(),
    }
    Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
