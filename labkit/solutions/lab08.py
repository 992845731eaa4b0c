"""Reference answers to Lab 8's exercises."""

from labkit.exercises import Answer

EX_8_1 = Answer(
    right=lambda timeout_s: timeout_s,
    wrong=lambda timeout_s: 5.0,
    wrong_because="the lab's 5 s timeout, not the one this run set",
)

EX_8_2 = Answer(
    right=lambda own_s, others_s: own_s > 3 * others_s and own_s - others_s > 0.15,
    wrong=lambda own_s, others_s: own_s > others_s,
    wrong_because="calls any rank slower than the others a straggler: one of two ranks always is",
)
