"""labkit.zero_probe: real DeepSpeed engines hold what labkit.zero predicts."""

import pytest

from labkit import launcher, nvme_offload, zero, zero_accounting
from labkit import zero_probe as zp

TINY = zp.ProbeSize(layers=8, width=32, batch=4, steps=1)


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if anything tries to start a rank: bad input must be refused first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was launched for input that should have been refused")

    monkeypatch.setattr(launcher, "launch", refuse)


def test_fp16_is_refused_on_the_cpu_before_any_rank_starts(no_ranks):
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        pytest.skip("this accelerator supports fp16; the refusal is for the CPU")
    with pytest.raises(ValueError, match="use dtype='bf16'"):
        zp.measure(zp.BASE_CONFIGS[:1], size=TINY, dtype="fp16")


def test_bad_stage_and_ranks_are_refused_before_any_rank_starts(no_ranks):
    with pytest.raises(ValueError, match="stage must be one of 0, 1, 2, 3"):
        zp.measure([zp.ProbeConfig("stage 4", 4)], size=TINY)
    with pytest.raises(ValueError, match="ranks must be >= 1, got 0"):
        zp.measure(size=TINY, ranks=0)
    with pytest.raises(ValueError, match="needs stage 3"):
        zp.measure([zp.ProbeConfig("bad", 2, offload_param="cpu")], size=TINY)
    with pytest.raises(ValueError, match="size.layers must be >= 1, got 0"):
        zp.measure(size=zp.ProbeSize(0, 32, 4, 1))
    with pytest.raises(ValueError, match="dtype must be 'bf16' or 'fp16'"):
        zp.measure(size=TINY, dtype="int8")
    with pytest.raises(ValueError, match="on_links needs gloo ranks on 2 or more nodes"):
        zp.measure(size=TINY, ranks=1, on_links=True)
    with pytest.raises(ValueError, match="backend must be 'gloo' .* or 'nccl'"):
        zp.measure(size=TINY, backend="mpi")


def _timed(config, rank, steps):
    empty = dict.fromkeys(zero_accounting.ROLES, 0)
    return zp.RankMeasurement(config=config, rank=rank, dp_degree=2, num_params=1, dtype="bf16",
                              accelerator=empty, host=empty, optimizer_class="", step_ms=steps)


def test_offload_slowdown_is_the_slowest_ranks_best_step_over_the_same_stage():
    stage2, offloaded = zp.BASE_CONFIGS[2], zp.CPU_OFFLOAD_CONFIGS[0]
    measurements = [_timed(stage2, 0, [10.0, 9.0]), _timed(stage2, 1, [12.0, 11.0]),
                    _timed(offloaded, 0, [30.0, 33.0]), _timed(offloaded, 1, [22.0, 40.0])]
    assert zp.slowest_best_step_ms(measurements, "stage 2") == 11.0
    assert zp.offload_slowdowns(measurements) == {offloaded.name: pytest.approx(30.0 / 11.0)}
    with pytest.raises(ValueError, match="no measurement of configuration 'stage 2'"):
        zp.offload_slowdowns(measurements[2:])


def test_nvme_offload_without_its_op_is_refused_with_the_reason(no_ranks):
    available, reason = nvme_offload.nvme_available()
    if available:
        pytest.skip("async_io is available here, so NVMe offload is allowed")
    assert "async_io" in reason
    with pytest.raises(ValueError, match="NVMe offload requested but unavailable"):
        zp.measure([zp.NVME_CONFIG], size=TINY)


def test_config_shrinks_zero3_buckets_and_names_the_offload_device():
    cfg = zp.deepspeed_config(zp.CPU_OFFLOAD_CONFIGS[1], dtype="bf16", batch=4)
    zero_cfg = cfg["zero_optimization"]
    assert zero_cfg["reduce_bucket_size"] <= 2**20 and zero_cfg["stage3_param_persistence_threshold"] == 0
    assert zero_cfg["offload_optimizer"]["device"] == "cpu" == zero_cfg["offload_param"]["device"]
    assert cfg["bf16"]["enabled"] and "fp16" not in cfg
    plain = zp.deepspeed_config(zp.BASE_CONFIGS[2], dtype="bf16", batch=4)
    assert "offload_optimizer" not in plain["zero_optimization"]
    assert plain["optimizer"]["params"]["torch_adam"] is True


def test_deepspeed_estimator_counts_18_bytes_where_the_paper_counts_14_or_16():
    psi, n, largest_layer = 1_000_000, 4, 1000
    estimates = zero_accounting.deepspeed_estimates(psi, largest_layer, n)
    assert estimates["stage 2"] - zero.model_state_bytes(psi, 2, n).total == (18 - 14) * psi // n
    assert estimates["stage 3"] - zero.model_state_bytes(psi, 3, n).total == (
        (18 - 16) * psi // n + 4 * largest_layer
    )


def test_the_one_gpu_offload_timing_reaches_one_nccl_rank_with_cuda_ops(monkeypatch):
    """The gpu profile's timing call, as notebook 04 makes it, up to the launch (no GPU needed)."""
    from labkit import dsops

    built, launched = {}, {}
    monkeypatch.setattr(dsops, "ensure_built", lambda names, accelerator=None: built.update(names=names, accelerator=accelerator))

    def fake_launch(fn, world_size, **kwargs):
        launched.update(world_size=world_size, **kwargs)
        return [[None] * len(kwargs["configs"])]

    monkeypatch.setattr(launcher, "launch", fake_launch)
    zp.measure(zp.OFFLOAD_TIMING_CONFIGS, size=TINY, ranks=1, backend="nccl", dtype="bf16")
    assert launched["world_size"] == 1 and launched["backend"] == "nccl"
    assert launched["configs"] == list(zp.OFFLOAD_TIMING_CONFIGS)
    assert built["accelerator"] is None and dsops.CPU_ADAM_OP in built["names"]


class _GpuWithoutBf16:
    """DeepSpeed's CUDA accelerator as the parent sees it on a V100 or T4."""

    def is_bf16_supported(self):
        return False

    def is_fp16_supported(self):
        return True

    def device_name(self):
        return "cuda"

    def create_op_builder(self, name):
        raise AssertionError("asked the parent's CUDA accelerator for an op the CPU ranks load")


def test_gloo_ranks_train_in_bf16_even_when_the_parents_gpu_has_no_bf16(monkeypatch):
    import deepspeed.accelerator

    from labkit import dsops

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: _GpuWithoutBf16())
    monkeypatch.setattr(dsops, "ensure_built", lambda names, accelerator=None: None)
    launched = {}

    def fake_launch(fn, world_size, **kwargs):
        launched.update(kwargs)
        return [[None]] * world_size

    monkeypatch.setattr(launcher, "launch", fake_launch)
    zp.measure(zp.BASE_CONFIGS[:1], size=TINY, ranks=2, backend="gloo")
    assert launched["dtype"] == "bf16"
    assert zp.default_dtype("gloo") == "bf16"
    assert zp.default_dtype("nccl") == "fp16"     # NCCL ranks run on that GPU: fp16 is its choice


MOUNTS = """\
overlay / overlay rw,relatime 0 0
tmpfs /tmp tmpfs rw,nosuid,nodev 0 0
/dev/nvme0n1p1 /tmp/scratch ext4 rw,relatime 0 0
/dev/nvme1n1 /mnt/my\\040disk xfs rw 0 0
"""


def test_filesystem_type_is_the_innermost_mount_holding_the_path():
    assert nvme_offload.filesystem_type("/tmp/labkit-nvme-1", MOUNTS) == "tmpfs"
    assert nvme_offload.filesystem_type("/tmp/scratch/labkit-nvme-1", MOUNTS) == "ext4"
    assert nvme_offload.filesystem_type("/tmp/scratchy", MOUNTS) == "tmpfs"
    assert nvme_offload.filesystem_type("/home/me", MOUNTS) == "overlay"
    assert nvme_offload.filesystem_type("/mnt/my disk/x", MOUNTS) == "xfs"
    assert nvme_offload.filesystem_type("/anything", "") == "unknown"


class _NoOpsWanted:
    def is_bf16_supported(self):
        return True

    def create_op_builder(self, name):
        pytest.fail(f"looked up {name} for a folder it cannot use")


def test_nvme_offload_into_tmpfs_is_refused_before_any_op_is_looked_up_or_built(monkeypatch, tmp_path, no_ranks):
    from labkit import dsops

    monkeypatch.setenv(nvme_offload.NVME_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(nvme_offload, "filesystem_type", lambda path, mounts_text=None: "tmpfs")
    monkeypatch.setattr(dsops, "ranks_accelerator", lambda backend=None: _NoOpsWanted())
    monkeypatch.setattr(dsops, "ensure_built", lambda *a, **kw: pytest.fail("started a build for tmpfs"))
    available, reason = nvme_offload.nvme_available("gpu", backend="gloo")
    assert not available
    assert "tmpfs" in reason and str(tmp_path) in reason and nvme_offload.NVME_DIR_ENV in reason
    with pytest.raises(ValueError, match="NVMe offload requested but unavailable: .*tmpfs"):
        zp.measure([zp.NVME_CONFIG], size=TINY, dtype="bf16", backend="gloo")


def test_nvme_offload_asks_the_cpu_ranks_accelerator_for_its_op(monkeypatch, tmp_path):
    import deepspeed.accelerator

    from labkit import dsops

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: _GpuWithoutBf16())
    monkeypatch.setattr(nvme_offload, "filesystem_type", lambda path, mounts_text=None: "ext4")
    monkeypatch.setattr(dsops, "op_is_built", lambda name, accelerator=None: accelerator == "cpu")
    assert nvme_offload.nvme_available("gpu", backend="gloo", nvme_dir=str(tmp_path))[0]
