"""Scheduling policies on hand-built arrivals: admission order, victim order, the aging bound.

The schedulers run here against a real paged cache without tensors (schedulers never touch
K/V); ``Drive`` plays the engine's part: it marks scheduled tokens computed, appends a token
when a sequence's uncomputed tokens are done, and retires finished sequences.
"""
from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from strategies.cache.paged import PagedCache
from strategies.scheduler.continuous import ContinuousScheduler
from strategies.scheduler.preemptive import PreemptiveScheduler


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 2, priority: int = 0) -> Sequence:
    return Sequence(seq_id, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens, priority=priority),
                    arrival_time=float(seq_id))


class Drive:
    """Steps a scheduler like the engine does; records first-admission order and victims."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.admitted: list[int] = []
        self.victims: list[int] = []
        self.finished: list[int] = []

    def step(self) -> None:
        plan = self.scheduler.schedule()
        self.victims += [seq.seq_id for seq in plan.preempted]
        done = []
        for item in plan.scheduled:
            seq = item.seq
            if seq.seq_id not in self.admitted:
                self.admitted.append(seq.seq_id)
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_output_tokens == seq.sampling_params.max_tokens:
                    done.append(seq)
        self.finished += [seq.seq_id for seq in done]
        self.scheduler.retire(done)

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError("scheduler did not finish")


def scheduler(kind=ContinuousScheduler, capacity_tokens: int = 1024, **options):
    return kind(PagedCache(block_size=4, capacity_tokens=capacity_tokens), max_model_len=256, **options)


# A: long, priority 1 | B: short, priority 0 | C: mid, priority 1 | D: shortest, priority 0
ARRIVALS = [(0, 12, 1), (1, 4, 0), (2, 8, 1), (3, 2, 0)]  # (seq_id, prompt_len, priority)


@pytest.mark.parametrize("policy, expected", [
    ("fcfs", [0, 1, 2, 3]),        # arrival order
    ("priority", [1, 3, 0, 2]),    # priority 0 first (B, D in arrival order), then A, C
    ("sjf", [3, 1, 2, 0]),         # prompt + max_tokens: 4, 6, 10, 14
])
def test_admission_order(policy, expected):
    drive = Drive(scheduler(policy=policy, max_num_seqs=1))  # one slot: admission order = service order
    for seq_id, prompt_len, priority in ARRIVALS:
        drive.scheduler.add(make_seq(seq_id, prompt_len, priority=priority))
    drive.run()
    assert drive.admitted == expected


def squeezed_three(policy: str):
    """Three running sequences of one block each in a 3-block pool; the next decode needs a 4th."""
    drive = Drive(scheduler(PreemptiveScheduler, capacity_tokens=12, policy=policy, max_num_seqs=3))
    # (id, priority, max_tokens), oldest first; 4-token prompts fill one block each, so every
    # sequence's first decode needs a second block -> preemptions.
    for seq_id, priority, max_tokens in [(0, 0, 4), (1, 1, 2), (2, 0, 3)]:
        drive.scheduler.add(make_seq(seq_id, 4, max_tokens=max_tokens, priority=priority))
    drive.step()  # prefill all three (one block each)
    assert sorted(drive.admitted) == [0, 1, 2] and not drive.victims
    drive.step()  # each needs a second block, 0 free: preemptions
    return drive


@pytest.mark.parametrize("policy, first_victim", [
    ("fcfs", 2),      # the youngest
    ("priority", 1),  # the lowest priority (largest value), although not the youngest
    ("sjf", 0),       # the longest job (4 + 4 tokens), although the oldest
])
def test_preemption_victim(policy, first_victim):
    drive = squeezed_three(policy)
    assert drive.victims[0] == first_victim
    drive.run()
    assert sorted(drive.finished) == [0, 1, 2]
    drive.scheduler.cache.pool.check_all_free()


def test_priority_ties_are_fcfs_and_later_urgent_requests_overtake():
    drive = Drive(scheduler(policy="priority", max_num_seqs=1))
    for seq_id in range(3):
        drive.scheduler.add(make_seq(seq_id, 4, priority=5))
    drive.step()  # 0 runs
    drive.scheduler.add(make_seq(9, 4, priority=-1))  # arrives later, more urgent
    drive.run()
    assert drive.admitted == [0, 9, 1, 2]


def starving_long_job(aging_steps: int, steps: int) -> Drive:
    """One long job waiting while a short job arrives every step (one slot): SJF alone never picks it."""
    drive = Drive(scheduler(policy="sjf", sjf_aging_steps=aging_steps, max_num_seqs=1))
    drive.scheduler.add(make_seq(0, 40, max_tokens=1))
    drive.scheduler.add(make_seq(1, 2, max_tokens=1))
    for step in range(steps):
        drive.scheduler.add(make_seq(100 + step, 2, max_tokens=1))
        drive.step()
    return drive


def test_sjf_starves_without_aging():
    drive = starving_long_job(aging_steps=10_000, steps=60)
    assert 0 not in drive.admitted and len(drive.admitted) == 60


def test_sjf_aging_bounds_the_wait():
    aging = 8
    drive = starving_long_job(aging_steps=aging, steps=60)
    # the long job (added before step 1) is aged at step `aging`, and nothing aged is ahead of it
    assert drive.admitted.index(0) == aging - 1  # admitted in step `aging` (steps count from 1)
    assert 0 in drive.finished


def test_policy_order_keeps_running_and_queue_consistent():
    # priority reorders the running set each step: victims always come from its end
    drive = squeezed_three("priority")
    running = drive.scheduler.running
    ranks = [(s.sampling_params.priority, s.arrival_time) for s in running]
    assert ranks == sorted(ranks)


def test_bad_policy_inputs():
    with pytest.raises(ValueError, match="fcfs, priority, sjf"):
        scheduler(policy="lifo")
    with pytest.raises(ValueError, match="sjf_aging_steps"):
        scheduler(policy="sjf", sjf_aging_steps=0)
    for bad in (1.5, "1", True, None):
        with pytest.raises(ValueError, match="priority must be an integer"):
            SamplingParams(priority=bad)
    with pytest.raises(ValueError, match="recompute, swap"):
        scheduler(PreemptiveScheduler, preemption_mode="discard")
