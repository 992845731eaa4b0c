"""Reference answers to Lab 8's exercises."""

import statistics

from labkit.exercises import Answer

EX_8_1 = Answer(
    right=lambda timeout_s: timeout_s,
    wrong=lambda timeout_s: 5.0,
    wrong_because="the lab's 5 s timeout, not the one this run set",
)

EX_8_2 = Answer(
    right=lambda own_s, others_s: min(own_s) / min(others_s) > 1.5,
    wrong=lambda own_s, others_s: statistics.median(own_s) > statistics.median(others_s),
    wrong_because="one of two ranks is always the slower: a rule without a margin calls a healthy rank slow",
)
