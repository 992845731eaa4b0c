"""Reference answers to the exercises (:mod:`labkit.exercises`), one module per lab.

Kept out of the notebooks: a learner opens this only to compare. Each answer
comes with a plausible wrong one, which the exercise's check must reject.
"""
