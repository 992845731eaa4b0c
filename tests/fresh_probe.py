"""A module for tests/test_fresh_process.py to run fresh: prints what it was given of its environment."""

import json
import os
import sys

if __name__ == "__main__":
    if sys.argv[1] == "fail":
        raise KeyError("told to fail")
    print("a line before the result")
    print(json.dumps({name: os.environ[name] for name in (sys.argv[1], "OMP_NUM_THREADS")}))
