"""The BatchScheduler with the prefix cache's second tier (GroupCapacity.tier_keys): driven against a
fake agent that keeps a pool and a tier as the real one does, each position's "KV" the token prefix
it was computed from. A step's spills run before its restores, both before its chunks (as
agent/service.py does); a restore the tier lacks leaves its block unwritten (garbage), and the
scheduler (tier_restore_failed) must recompute that sequence from the failed block on, its slot
released, none of the garbage ever read or hit."""

import random

from agent.contract.sampling import Sampled, SamplingParams
from scheduler.batch_scheduler import BatchScheduler
from scheduler.plan import GroupCapacity
from scheduler.sequence import Sequence

SIZE = 4
GARBAGE = ("garbage",)


class TieredAgent:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.kv: dict[tuple[int, int], tuple] = {}  # (block, offset) -> the prefix it holds
        self.tier: dict[str, list] = {}  # digest -> a block's positions
        self.lose: set[str] = set()  # digests the tier lost (a corrupt file, say)
        self.held: dict[int, int] = {}  # slot -> positions it holds
        self.sampled: set[int] = set()  # slots that sampled (a prompt's last chunk ran)
        self.restored = 0

    def move(self, spills, restores) -> list[str]:
        for block, digest in spills:
            self.tier[digest] = [self.kv.get((block, o)) for o in range(self.block_size)]
        failed = []
        for digest, block in restores:
            if digest in self.tier and digest not in self.lose:
                for o, value in enumerate(self.tier[digest]):
                    self.kv[(block, o)] = value
                self.restored += 1
            else:
                failed.append(digest)
                for o in range(self.block_size):
                    self.kv[(block, o)] = GARBAGE
        return failed

    def _check(self, table, tokens, upto):
        for p in range(upto):
            at = (table[p // self.block_size], p % self.block_size)
            assert self.kv.get(at) == tuple(tokens[: p + 1]), f"position {p}: wrong or missing KV"

    def prefill(self, slot, tokens, table, start, end, sample, garbage=False):
        assert start <= self.held.get(slot, start)
        assert not (sample and slot in self.sampled), f"slot {slot} has sampled already"
        if not garbage:
            self._check(table, tokens, start)
        for p in range(start, end):
            self.kv[(table[p // self.block_size], p % self.block_size)] = (
                GARBAGE if garbage else tuple(tokens[: p + 1])
            )
        self.held[slot] = end
        if sample:
            self.sampled.add(slot)
        return tokens[end - 1] + 1 if sample else None

    def decode(self, slot, tokens, table):
        """`tokens`: the sequence's, its pending one last (whose KV this step writes)."""
        self._check(table, tokens, len(tokens) - 1)
        p = len(tokens) - 1
        self.kv[(table[p // self.block_size], p % self.block_size)] = tuple(tokens)
        self.held[slot] = len(tokens)
        return tokens[-1] + 1

    def release(self, slot):
        self.held.pop(slot, None)
        self.sampled.discard(slot)


def make(num_blocks: int, slots: int = 1) -> tuple[BatchScheduler, TieredAgent]:
    capacity = GroupCapacity(slots, 24, num_blocks, SIZE, 32, tier_keys=())
    return BatchScheduler([capacity], max_waiting=64), TieredAgent(SIZE)


def step(scheduler: BatchScheduler, agent: TieredAgent) -> None:
    """One plan, as StepExecutor runs it: the tier's moves with the group's first call, a failed
    restore's sequences preempted and their slots released, their chunks' results dropped."""
    plan = scheduler.schedule()
    for _, slot, _ in plan.releases:
        agent.release(slot)
    blocks = scheduler.blocks[0]
    restores = blocks.take_restores()
    tables = {c.seq.request_id: blocks.table(c.seq.request_id) for c in plan.prefills}
    failed = agent.move(blocks.take_spills(), restores)
    preempted = scheduler.tier_restore_failed(0, failed, restores) if failed else []
    for seq in plan.decodes.get(0, []):
        assert seq not in preempted  # a decoding sequence holds no block being restored
        token = agent.decode(seq.slot, seq.tokens(seq.positions_used + 1), blocks.table(seq.request_id))
        scheduler.decoded([seq], [[Sampled(token)]])
    for chunk in plan.prefills:
        seq = chunk.seq
        if seq in preempted:  # the agent ran it on garbage; then its slot was released
            agent.prefill(
                seq.slot, seq.tokens(chunk.end), tables[seq.request_id], chunk.start, chunk.end, False, True
            )
            continue
        table = blocks.table(seq.request_id)
        token = agent.prefill(seq.slot, seq.tokens(chunk.end), table, chunk.start, chunk.end, chunk.sample)
        scheduler.prefilled(chunk, None if token is None else Sampled(token))
    for seq in preempted:
        agent.release(seq.slot)


def answer(scheduler: BatchScheduler, agent: TieredAgent, rid: str, prompt: list[int], new: int = 3):
    seq = Sequence(rid, list(prompt), SamplingParams(), new, frozenset())
    scheduler.add(seq)
    for _ in range(100):
        if seq.finished:
            assert seq.error is None, seq.error
            return seq
        step(scheduler, agent)
    raise AssertionError("never finished")


PROMPT = list(range(100, 113))  # three full blocks and one position
OTHER = list(range(200, 221))  # with a pool of 6 blocks, it pushes PROMPT's blocks out


def test_an_evicted_prefix_comes_back_from_the_tier_and_answers_as_computed():
    scheduler, agent = make(num_blocks=6)
    assert answer(scheduler, agent, "p", PROMPT).output == [113, 114, 115]
    answer(scheduler, agent, "o", OTHER)
    again = answer(scheduler, agent, "p2", PROMPT)
    assert again.output == [113, 114, 115] and agent.restored == 3
    assert scheduler.blocks[0].tier_hit_tokens == 3 * SIZE


def test_a_restore_the_tier_lost_recomputes_from_that_block_and_is_never_hit():
    scheduler, agent = make(num_blocks=6)
    answer(scheduler, agent, "p", PROMPT)
    answer(scheduler, agent, "o", OTHER)
    blocks = scheduler.blocks[0]
    lost = sorted(agent.tier)[0]
    agent.lose.add(lost)
    again = answer(scheduler, agent, "p2", PROMPT)
    assert again.output == [113, 114, 115] and again.preemptions >= 1
    assert lost not in blocks.tier_keys
    # computed again, the block is in the pool: a third request hits it there, nothing lost
    assert answer(scheduler, agent, "p3", PROMPT).output == [113, 114, 115]


def test_random_prompts_with_shared_prefixes_and_lost_blocks_all_answer_right():
    rng = random.Random(7)
    scheduler, agent = make(num_blocks=10, slots=2)
    stems = [[rng.randrange(1000, 2000) for _ in range(12)] for _ in range(4)]
    for i in range(60):
        prompt = rng.choice(stems)[: rng.randrange(5, 13)] + [rng.randrange(3000, 4000)] * rng.randrange(0, 8)
        if agent.tier and rng.random() < 0.3:
            agent.lose.add(rng.choice(sorted(agent.tier)))
        out = answer(scheduler, agent, f"r{i}", prompt, new=rng.randrange(1, 4))
        assert out.output == [prompt[-1] + 1 + k for k in range(len(out.output))]
    assert agent.restored > 0
