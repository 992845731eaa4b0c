"""Activation checkpointing: the same gradients for less memory, and a model that says how much less."""

import json
import subprocess

import pytest
import torch

from labkit import fresh_process, recompute

SMALL = recompute.RecomputeSize(blocks=3, width=8, tokens=16, repeats=1)


def test_checkpointing_gives_the_same_gradients_as_keeping_every_activation():
    model = recompute.make_model(SMALL)
    x = torch.randn(SMALL.tokens, SMALL.width)
    grads = {}
    for kind in recompute.KINDS:
        recompute.train_step(model, x, kind)
        grads[kind] = [p.grad.clone() for p in model.parameters()]
    for kept, recomputed in zip(*grads.values()):
        torch.testing.assert_close(kept, recomputed)


def test_checkpointed_model_keeps_block_inputs_plus_one_block():
    per_block = 4 * SMALL.tokens * SMALL.width * 9
    grads = 4 * SMALL.num_params
    assert recompute.modelled_peak_bytes(SMALL, recompute.KINDS[0]) == 3 * per_block + grads
    assert recompute.modelled_peak_bytes(SMALL, recompute.KINDS[1]) == 3 * 4 * SMALL.tokens * SMALL.width + per_block + grads


def test_num_params_counts_weights_and_biases():
    assert SMALL.num_params == sum(p.numel() for p in recompute.make_model(SMALL).parameters())


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="kind"):
        recompute.modelled_peak_bytes(SMALL, "keep half")
    with pytest.raises(ValueError, match="device must be 'cpu' or a CUDA device"):
        recompute.measure(SMALL, device="tpu")
    with pytest.raises(ValueError, match="device must be 'cpu' or a CUDA device"):
        recompute.measure_peaks(SMALL, device="tpu")
    with pytest.raises(ValueError, match="blocks"):
        recompute.RecomputeSize(blocks=0, width=8, tokens=16, repeats=1)


def test_cpu_steps_are_timed_apart_from_the_peak_probes_allocator(monkeypatch):
    """The peak probe maps every large allocation on its own; timed there, steps also paid page faults. The time
    probe keeps freed blocks for the next step (no page faults that come and go with glibc's mmap threshold)."""
    calls = []

    def fake_run(argv, env, **kwargs):
        calls.append((argv[-1], env))
        out = ({kind: 1 for kind in recompute.KINDS} if argv[-1] == "peaks" else
               {"step_ms": {kind: 1.0 for kind in recompute.KINDS}, "forward_ms": 0.5, "spread": {}})
        return subprocess.CompletedProcess(argv, 0, stdout=json.dumps(out), stderr="")

    monkeypatch.setattr(fresh_process.subprocess, "run", fake_run)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    recompute.measure(SMALL)
    envs = dict(calls)
    assert set(envs) == {"peaks", "times"}
    assert envs["peaks"]["MALLOC_MMAP_THRESHOLD_"] == "65536"
    assert int(envs["times"]["MALLOC_MMAP_THRESHOLD_"]) >= 1 << 30 and int(envs["times"]["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 30
    calls.clear()
    assert recompute.measure_peaks(SMALL) == {kind: 1 for kind in recompute.KINDS}
    assert [part for part, _ in calls] == ["peaks"]   # Exercise 4.2's measurement: the peak probe alone
    assert envs["peaks"]["OMP_NUM_THREADS"] == envs["times"]["OMP_NUM_THREADS"] == "1"

