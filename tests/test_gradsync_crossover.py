"""Lab 5's crossover: a long enough accumulation window lets two ranks beat one rank alone."""

import math

import pytest

from labkit import gradsync_crossover as gx
from labkit.gradsync_links import LinkMode

SIZES = gx.CrossoverSizes(hidden=64, layers=2, micro_batch=4, windows=(1, 4, 16, 64), timed_steps=1, rounds=1)


def _result(alone_ms_per_micro_batch: float, ceiling_ms_per_micro_batch: float, sync_ms: float) -> gx.CrossoverResult:
    """What the ranks would measure if every step were exactly compute plus one sync."""
    longest = max(SIZES.windows)
    return gx.CrossoverResult(
        link_mode=LinkMode("namespaces", "synthetic"), sizes=SIZES, world_size=2,
        alone_step_s=longest * alone_ms_per_micro_batch / 1e3, ceiling_step_s=longest * ceiling_ms_per_micro_batch / 1e3,
        delayed_step_s={w: (w * ceiling_ms_per_micro_batch + sync_ms) / 1e3 for w in SIZES.windows})


def test_delayed_sync_pays_one_sync_per_window_of_compute():
    assert gx.predicted_samples_per_s(16, 2, 4, 0.002, 0.016) == pytest.approx(2 * 16 * 4 / (16 * 0.002 + 0.016))
    with pytest.raises(ValueError, match="window, world_size and micro_batch must be >= 1"):
        gx.predicted_samples_per_s(0, 2, 4, 0.002, 0.016)


def test_two_ranks_cross_one_once_the_window_saves_more_compute_than_one_sync_costs():
    # one rank 1.6 ms per micro-batch, two ranks 2.0 ms each side by side: 1.2 ms saved per micro-batch
    assert gx.predicted_crossover_window(0.0016, 0.0020, 0.012) == pytest.approx(10.0)
    assert gx.predicted_crossover_window(0.0016, 0.0032, 0.012) == math.inf


def test_the_sweep_finds_the_crossover_the_model_predicts():
    result = _result(alone_ms_per_micro_batch=1.6, ceiling_ms_per_micro_batch=2.0, sync_ms=12.0)
    assert result.sync_s() == pytest.approx(0.012)
    assert result.predicted_crossover_window() == pytest.approx(10.0)
    assert result.measured_crossover_window() == 16
    assert all(result.predicted_samples_per_s(w) == pytest.approx(result.samples_per_s(w)) for w in SIZES.windows)
    assert result.samples_per_s(64) < result.ceiling_samples_per_s < 2 * result.alone_samples_per_s


def test_what_we_saw_follows_the_values():
    said = " ".join(gx.crossover_sentences(_result(1.6, 2.0, 12.0)))
    assert "reached 1.60x one rank alone" in said and "first beat one at a window of 16" in said
    assert "two ranks were 1.46x faster than one rank" in said and "over 1 micro-batch, 4.38x slower" in said
    never = " ".join(gx.crossover_sentences(_result(1.6, 3.6, 12.0)))
    assert "never beat one" in never and "no window: no core to spare" in never


def test_windows_must_increase_and_the_rate_be_positive():
    with pytest.raises(ValueError, match="windows must be increasing window lengths >= 1"):
        gx.CrossoverSizes(hidden=64, layers=2, micro_batch=4, windows=(4, 1), timed_steps=1, rounds=1)
    with pytest.raises(ValueError, match="rate_gbit must be > 0"):
        gx.CrossoverSizes(hidden=64, layers=2, micro_batch=4, windows=(1, 4), timed_steps=1, rounds=1, rate_gbit=0)
    with pytest.raises(ValueError, match="world_size must be >= 2"):
        gx.run_crossover(world_size=1)


@pytest.mark.slow
def test_on_a_slow_emulated_link_a_long_window_beats_syncing_every_micro_batch():
    sizes = gx.CrossoverSizes(hidden=64, layers=2, micro_batch=4, windows=(1, 16), timed_steps=1, rounds=1,
                              rate_gbit=0.01)
    result = gx.run_crossover(sizes=sizes, mode=LinkMode("emulated", "asked for"))
    assert not result.real_links
    assert result.samples_per_s(16) > 4 * result.samples_per_s(1)
    gradient_bytes = 2 * (64 * 64 + 64) * 4  # two ranks: the ring sends the whole gradient once each way
    assert result.sync_s() > 0.5 * gradient_bytes * 8 / 0.01e9  # at least half the slept all-reduce


def test_lab5_modules_import_without_a_circle():
    """gradsync, its model, DeepSpeed's counts and the crossover share what they train through gradsync_workload."""
    import ast
    from pathlib import Path

    import labkit

    folder = Path(labkit.__file__).parent
    names = ["gradsync", "gradsync_model", "gradsync_deepspeed", "gradsync_crossover", "gradsync_workload", "gradsync_links",
             "ddp_overlap", "ddp_overlap_model"]
    imports = {}
    for name in names:
        tree = ast.parse((folder / f"{name}.py").read_text())
        found = {node.module.split(".")[-1] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imports[name] = found & set(names)

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in imports[start])

    assert not [name for name in names if reaches(name, name)]
