"""The test suite runs every exercise with its reference answer (see labkit.exercises)."""

import os

os.environ.setdefault("LABKIT_SOLUTIONS", "1")
