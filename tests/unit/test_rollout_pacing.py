"""Start pacing (rollart/rollout/pacing.py), by hand: 1,024 episodes/s, so each 2^-10 s of
clock is one episode and every figure below is exact in binary floating point."""

from rollart.rollout.pacing import StartPacer

TICK = 2.0**-10  # one episode's worth of time at 1,024/s


def test_slices_start_whole_groups_and_carry_the_rest():
    p = StartPacer(rate=1024.0, burst_s=4 * TICK, per_group=4)
    assert p.allowed(1.0, continued=False) == 1  # the burst: 4 episodes, one group
    p.started(1)
    assert p.budget == 0
    assert p.allowed(1.0 + 3 * TICK, continued=True) == 0  # 3 episodes: not a group yet
    assert p.allowed(1.0 + 6 * TICK, continued=True) == 1  # 3 + 3
    p.started(1)
    assert p.budget == 2  # carried to the next slice
    assert p.allowed(1.0 + 8 * TICK, continued=True) == 1  # 2 + 2


def test_a_full_admission_keeps_the_budget_and_a_late_slice_gets_one_second_at_most():
    p = StartPacer(rate=1024.0, burst_s=4 * TICK, per_group=4)
    assert p.allowed(1.0, continued=False) == 1
    p.started(0)  # the scheduler admitted nothing
    assert p.budget == 4
    assert p.allowed(5.0, continued=True) == (4 + 1024) // 4  # 4 s late: 1 s of the rate
    p.started(3)
    assert p.budget == 4 + 1024 - 12
    assert p.allowed(6.0, continued=False) == 1  # a new fill begins with the burst only
