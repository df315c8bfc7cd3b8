"""verify's worker with one rank's reduced-gradient shard made wrong after backward: what
`commfx verify` must catch under shard_states:stage=2|3."""

from commfx.runtime.state_shards import ShardedGradSync
from commfx.verify import verify_worker


def verify_with_a_wrong_shard(rank: int, world_size: int, cases: list, wrong_rank: int = 1, delta: float = 1e-6) -> list[dict]:
    """verify_worker, with `delta` added on `wrong_rank` to the first element of its shard of
    the first bucket cut over more than one rank; each result names the parameter that element
    belongs to ("wrong": None on the other ranks)."""
    finish = ShardedGradSync.finish
    wrong: list[str] = []

    def finish_then_corrupt(self):
        reduced = finish(self)
        if rank == wrong_rank:
            shard = next(s for s in self.shards if s.parts > 1)
            shard.grad[0] += delta
            begin = shard.range[0]
            wrong.append(next(self.slots[slot].name for slot, start in shard.starts.items() if start <= begin < start + self.slots[slot].param.numel()))
        return reduced

    ShardedGradSync.finish = finish_then_corrupt
    try:
        results = verify_worker(rank, world_size, cases)
    finally:
        ShardedGradSync.finish = finish
    for result, name in zip(results, wrong if wrong else [None] * len(results)):
        result["wrong"] = name
    return results
