"""A status's recent durations: the last ones kept, their median in ms."""

from swarmd.observe.recent import RecentTimes


def test_the_median_is_of_the_last_durations_kept_in_milliseconds():
    recent = RecentTimes(keep=3)
    assert recent.median_ms() is None
    for seconds in (0.010, 0.001, 0.002, 0.003):  # the first falls out
        recent.add(seconds)
    assert recent.median_ms() == 2.0
