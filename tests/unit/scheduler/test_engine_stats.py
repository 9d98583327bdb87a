"""EngineStats (scheduler/engine_stats.py) as BatchScheduler.stats builds it from the scheduler's own
state: each group's running sequences, slot releases not yet answered (planned, and sent), health
and KV blocks, and the totals every observer reads."""

from agent.contract.sampling import SamplingParams
from scheduler.batch_scheduler import BatchScheduler
from scheduler.engine_stats import EngineStats, GroupStats
from scheduler.plan import GroupCapacity
from scheduler.sequence import Sequence


def capacity(role: str = "mixed") -> GroupCapacity:
    return GroupCapacity(num_slots=4, max_seq_len=64, num_blocks=16, block_size=16, max_chunk=32, role=role)


def test_stats_follow_the_scheduler_group_by_group():
    scheduler = BatchScheduler([capacity(), capacity()], max_waiting=8)
    agents = [("tcp://a:1",), ("tcp://b:1", "tcp://b:2")]
    for i in range(3):
        scheduler.add(Sequence(f"r{i}", list(range(5 + i)), SamplingParams(), 4))
    scheduler.schedule()
    stats = scheduler.stats(agents, {1: 2})
    assert stats.started and stats.running + stats.waiting == 3
    assert [g.running for g in stats.groups] == [
        sum(1 for seq in scheduler.running.values() if seq.group == g) for g in (0, 1)
    ]
    assert [g.agents for g in stats.groups] == agents
    assert [g.releases_pending for g in stats.groups] == [0, 2]  # sent to group 1's agent, unanswered
    assert stats.tokens_in_flight == scheduler.tokens_in_flight > 0
    used = sum(blocks.num_used for blocks in scheduler.blocks)
    assert (
        stats.kv_blocks("used") == used > 0
        and stats.slots == stats.usable_slots == 2 * capacity().usable_slots
    )
    scheduler.healthy[1] = False  # a group down: its slots and blocks leave the totals
    down = scheduler.stats(agents, {})
    assert (
        down.groups[1].slots == 0
        and down.slots == capacity().usable_slots
        and down.usable_slots == 2 * capacity().usable_slots
    )
    assert down.kv_blocks("used") == scheduler.blocks[0].num_used


def test_before_the_groups_connect_the_stats_are_empty_but_name_the_agents():
    stats = EngineStats(started=False, groups=(GroupStats(group=0, agents=("tcp://a:1",), role="prefill"),))
    assert stats.slots == 0 and stats.kv_blocks("free") == 0
    assert not stats.groups[0].decodes and stats.groups[0].kv_blocks is None
