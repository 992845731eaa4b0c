"""Reference answers to Lab 8's exercises."""

import statistics

from labkit.exercises import Answer

EX_8_1 = Answer(
    right=lambda timeout_s: timeout_s,
    wrong=lambda timeout_s: 3.0,
    wrong_because="the 3 s timeout of the run with faults, not the one this run set",
)

EX_8_2 = Answer(
    right=lambda own_s, others_s, factor: min(own_s) / min(others_s) > factor,
    wrong=lambda own_s, others_s, factor: statistics.median(own_s) > statistics.median(others_s),
    wrong_because="one of two ranks is always the slower: a rule without a margin calls a healthy rank slow",
)
