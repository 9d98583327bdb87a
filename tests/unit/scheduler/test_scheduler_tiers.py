"""The BatchScheduler with the prefix cache's second tier (GroupCapacity.tier_keys): driven against a
fake agent that keeps a pool and a tier as the real one does, each position's "KV" the token prefix
it was computed from. A step's spills run before its restores, both before its chunks (as
agent/service.py does); a restore the tier lacks leaves its block unwritten (garbage), which the
step's chunks reading it compute from; told so by the reply (restore_failed), the scheduler must
recompute that sequence from the failed block on, its slot released first, none of the garbage ever
read or hit."""

import random

from agent.contract.sampling import Sampled, SamplingParams
from agent.contract.step_reply import StepReply
from scheduler.batch_scheduler import BatchScheduler
from scheduler.plan import GroupCapacity, PlannedStep, StepOutcome
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

    def prefill(self, slot, tokens, table, start, end, sample):
        """A chunk; one that reads a block a failed restore left is computed from the garbage."""
        assert start <= self.held.get(slot, start)
        assert not (sample and slot in self.sampled), f"slot {slot} has sampled already"
        at = [(table[p // self.block_size], p % self.block_size) for p in range(start)]
        garbage = any(self.kv.get(a) == GARBAGE for a in at)
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
    """One plan, its calls run on the agent in order and their outcomes updated."""
    plan = scheduler.schedule()
    outcomes = []
    for part in plan.parts.values():
        for release in part.releases:
            agent.release(release.slot)
        for planned in part.steps:
            reply = run(agent, planned)
            outcomes.append(StepOutcome(group=0, agent="tiered", part=planned, reply=reply))
    scheduler.update(outcomes)


def run(agent: TieredAgent, planned: PlannedStep) -> StepReply:
    """The call as agent/service.py runs it: the tier's moves, then the decode rows, then the chunks."""
    request = planned.request
    failed = agent.move(request.spill, request.restore)
    decoded = []
    for seq, slot, table in zip(planned.decodes, request.slots, request.tables):
        decoded.append([Sampled(agent.decode(slot, seq.tokens(seq.positions_used + 1), table))])
    firsts = []
    for c in request.chunks:
        token = agent.prefill(c.slot, list(c.tokens), c.table, c.start, len(c.tokens), c.sampling is not None)
        firsts.append(None if token is None else Sampled(token))
    return StepReply(decoded, firsts, restore_failed=failed)


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
