import threading
import time

import pytest

from tests.two_at_a_time import TwoAtATime


def _overlaps(timeline):
    return [(a, b) for i, (a, start_a, end_a) in enumerate(timeline) for (b, start_b, end_b) in timeline[i + 1:]
            if start_a < end_b and start_b < end_a]


def test_two_run_at_once_but_never_two_of_a_group_and_an_alone_job_by_itself():
    jobs = ["alone-1", "a-1", "a-2", "b-1", "b-2", "c-1"]
    running, most = set(), [0]
    lock = threading.Lock()

    def run(job):
        with lock:
            running.add(job)
            most[0] = max(most[0], len(running))
        time.sleep(0.05)
        with lock:
            running.discard(job)
        return job.upper()

    runs = TwoAtATime(jobs, run, group=lambda job: job.split("-")[0], alone=lambda job: job.startswith("alone"))
    assert [runs.result(job) for job in jobs] == [job.upper() for job in jobs]
    runs.stop()
    overlapping = _overlaps(runs.timeline)
    assert most[0] == 2 and overlapping, "two jobs ran at once"
    assert all(a.split("-")[0] != b.split("-")[0] for a, b in overlapping), overlapping
    assert not any("alone-1" in pair for pair in overlapping), overlapping


def test_a_jobs_exception_is_raised_by_its_result_and_the_others_still_run():
    def run(job):
        if job == "bad":
            raise ValueError("broken on purpose")
        return job

    runs = TwoAtATime(["bad", "good"], run, group=str, alone=lambda job: False)
    with pytest.raises(ValueError, match="broken on purpose"):
        runs.result("bad")
    assert runs.result("good") == "good"
    runs.stop()


def test_the_same_job_twice_is_refused():
    with pytest.raises(ValueError, match="distinct"):
        TwoAtATime(["x", "x"], str, group=str, alone=lambda job: False)
