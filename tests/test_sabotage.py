"""Every lab's asserts can fail: break the mechanism a lab teaches and its own assert must catch it.

Each sabotage is a few lines of Python that replace a labkit function with a broken one (the
cache that decodes again, the fused kernel that is not fused, the ZeRO stage that keeps the whole
optimizer). The harness runs the lab's notebook with that code as an extra first cell, and writes
the same code to a ``sitecustomize.py`` on ``PYTHONPATH`` so that every process the kernel spawns
(ranks, DataLoader workers started by spawn) is broken the same way as soon as it imports labkit.
Only the cells up to the expected failure run. The test passes when that cell, and no earlier
one, fails with an ``AssertionError`` whose text names the invariant. The unsabotaged notebooks
pass under nbval in the same suite, so each pair shows an assert that holds and can fail.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from labkit.course import notebooks_dir
from tests.forked_kernels import ForkedKernelManager, close_zygote

REPO = Path(__file__).resolve().parent.parent
CELL_TIMEOUT_S = 600


@dataclass(frozen=True)
class Sabotage:
    notebook: str
    name: str
    code: str
    fails_at: str
    """The id of the cell whose assert must fail."""
    says: str
    """Text of the failing assert: its source line or its message."""
    needs: tuple[str, ...] = ()
    """Ids of the cells the failing one depends on; empty: every cell before it."""
    trim: str = ""
    """Code run after ``code`` (which must patch before anything imports what it breaks) that shrinks work
    the failing cell does not read (see the TRIM_* notes)."""
    alone: bool | None = None
    """Whether it runs by itself (marked ``alone``); None: as its lab's others do (:data:`ALONE_LABS`). False
    where the failing assert, and every assert the run meets before it, compares counts, bytes or digests,
    never a time or a rate; True where what it runs sizes itself from a time (Lab 8's interval experiment), or
    where a neighbour's load could move the count it fails on (the steps before Lab 8's straggler verdict)."""


# Trims: the failing cell reads only part of what the cells it needs compute (Lab 6's byte counts, not
# its step times at three link rates), so the sabotaged run skips the rest: 40 s -> 14 s for Lab 6's
# launch; leaving out Lab 5's DeepSpeed rows saves 2.6 s a run, and Lab 4's byte counts need one step,
# not three, and no links where the failing cell reads no traffic (about 3 s a run); Lab 1's rungs that read the store wait 2 ms per GET instead of 10 when the failing cell
# reads their request counts or busy fractions, not their rate (22 s -> 14 s for the raw cache that GETs
# again). The worker sweep keeps its five rounds even when sabotaged: with one, the two
# zero-worker loaders differed by chance enough to pass cell-23 once in CI. Where the failing cell reads GET counts or the store's rate,
# not a busy fraction, or the diagnosis's shares of the loader's wait, the sleeping stand-in replaces the
# accelerator that is sized on its own core (about 4 s of each run's set-up). Lab 8's NaN sabotage injects only the NaN: one restart instead of four
# and no 3 s wait to detect a hang (55-65 s -> 20 s, measured with a 5 s wait). Lab 8's interval sabotage that breaks the final weights gives
# the longest interval four failures' work instead of twelve (the others half that, as in the lab), and so does the one
# whose baseline saves too (its goodputs rise with the baseline's saves, 1.31-1.36x in three runs with four failures);
# the one that breaks the ordering keeps eight for every loop, since with saves off the clock the shortest interval
# leads only by the work its failures redo, and four average that poorly (with eight it led the middle by 0.06-0.09
# in three runs, and the loops took 7.9-13.2 s, against 22.7-23.5 s with twelve). Lab 5's crossover sabotage, which syncs every micro-batch, runs
# windows of 1 and 128 only: at 256 its longest window alone would take about 17 s of syncs, and at 64 the trim
# alone reached only 58-80% of the ceiling in three runs (DDP's own cost per micro-batch and the one sync weigh
# more in a shorter window), too near the lab's 60% floor. Lab 5's diagnosis
# sabotage measures the one rate it diagnoses, 0.5 Gbit/s. Lab 3's eager multiply-add chain runs chains of 1, 2
# and 4 only: all five, up to 16 multiply-adds, took 45 s eager, the three 6 s. Lab 7's diagnosis sabotages profile
# three steps of an eight-step loop, not eight of thirteen: the failing cell compares the profile's checkpoint
# share with the loop's own clock over the same steps: trimmed, the sabotages made it 0.00 and 1.00 against the
# loop's 0.79 and 0.78 (5.8 s a run instead of 8.0). Each trim alone leaves its
# failing cell passing (checked with `python -m tests.test_sabotage --trims-only`), so the failure comes from
# the sabotage, not the trim.
TRIM_LAB1_SHORT_LATENCY = """
    import dataclasses
    from labkit import ladder
    ladder.SIZES = {name: dataclasses.replace(size, remote_latency_ms=2) for name, size in ladder.SIZES.items()}
"""
TRIM_LAB1_STAND_IN = """
    from labkit import accelerator
    accelerator.split_cores = lambda: None
"""
TRIM_LAB1_SMALL_PARQUET = """
    import dataclasses
    from labkit import ladder
    ladder.SIZES = {name: dataclasses.replace(size, parquet_images=256) for name, size in ladder.SIZES.items()}
"""
TRIM_LAB2_SHORT_RACE = """
    import dataclasses
    from labkit import dataengine, store_race
    dataengine.SIZES = {name: dataclasses.replace(size, race_images=256) for name, size in dataengine.SIZES.items()}
    _race = store_race.race
    store_race.race = lambda *args, **kwargs: _race(*args, **{**kwargs, "rounds": 1})
"""
TRIM_LAB3_SHORT_CHAINS = """
    from labkit import fused_intensity
    _measure = fused_intensity.measure
    fused_intensity.measure = lambda *args, **kwargs: _measure(*args, **{**kwargs, "lengths": (1, 2, 4)})
"""
TRIM_LAB4_NO_NVME = """
    import dataclasses
    from labkit import nvme_offload, zero_probe
    nvme_offload.nvme_available = lambda *args, **kwargs: (False, "NVMe offload left out: the sabotage does not read it")
    zero_probe.SIZES = {name: dataclasses.replace(size, steps=1) for name, size in zero_probe.SIZES.items()}
"""
TRIM_LAB4_BASE_ONLY = TRIM_LAB4_NO_NVME + """
    zero_probe.CPU_OFFLOAD_CONFIGS = ()
"""
TRIM_LAB4_NO_LINKS = TRIM_LAB4_BASE_ONLY + """
    from labkit import fabric
    fabric.probe = lambda: fabric.Capability("emulated", "links left out: the sabotage reads no bytes on links")
"""
TRIM_LAB5_RATES = """
    from labkit import gradsync
    gradsync.RATES_GBIT = ({rates})
    _experiment = gradsync.run_experiment
    gradsync.run_experiment = lambda *args, **kwargs: _experiment(
        *args, **{{**kwargs, "rates_gbit": gradsync.RATES_GBIT, "deepspeed_stages": ()}})
"""
TRIM_LAB5_TWO_WINDOWS = """
    import dataclasses
    from labkit import gradsync_crossover
    gradsync_crossover.SIZES = {name: dataclasses.replace(size, windows=(1, 128))
                                for name, size in gradsync_crossover.SIZES.items()}
"""
TRIM_LAB8_ASSUMED_LINKS = """
    from labkit import fabric
    fabric.probe = lambda: fabric.Capability("emulated", "links not measured: the sabotage reads the simulator only")
"""
TRIM_LAB8_NAN_ONLY = """
    from labkit import fault_plan
    fault_plan.SUDDEN_KINDS = ("nan",)
"""
TRIM_LAB8_KILL_ONLY = """
    from labkit import fault_plan
    fault_plan.SUDDEN_KINDS = ("kill",)
"""
TRIM_LAB8_FAILURES = """
    import dataclasses
    from labkit import interval_runs
    interval_runs.SIZES = {{name: dataclasses.replace(size, failures={failures}, shorter_share={share})
                           for name, size in interval_runs.SIZES.items()}}
"""
TRIM_LAB7_SHORT_DIAGNOSIS = """
    from labkit import checkpoint_stalls, diagnose
    _diagnosis, _train = diagnose.Diagnosis.__init__, checkpoint_stalls.train_with_checkpoints
    diagnose.Diagnosis.__init__ = lambda self, out, **kwargs: _diagnosis(self, out, **{**kwargs, "steps": 3})
    checkpoint_stalls.train_with_checkpoints = lambda *args, **kwargs: _train(*args, **{**kwargs, "steps": 8})
"""
TRIM_LAB6_BYTES_ONLY = """
    import dataclasses
    from labkit import zeropp_fabric
    zeropp_fabric.SIZES = {name: dataclasses.replace(size, rates_gbit=(max(size.rates_gbit),),
                                                     micro_batches=size.micro_batches[:1], timed_steps=1, train_steps=1)
                           for name, size in zeropp_fabric.SIZES.items()}
"""
TRIM_LAB6_SLOWEST_RATE = """
    import dataclasses
    from labkit import zeropp_fabric
    zeropp_fabric.SIZES = {name: dataclasses.replace(size, rates_gbit=(min(size.rates_gbit),),
                                                     train_steps=1)
                           for name, size in zeropp_fabric.SIZES.items()}
"""

ASYNC_SAVE_THAT_WAITS = """
    from labkit import savers
    _save = savers.AsyncSaver.save
    def _save_and_wait(self, step, state):
        stats = _save(self, step, state)
        self.wait()
        return stats
    savers.AsyncSaver.save = _save_and_wait
"""

SABOTAGES = [
    Sabotage("01_input_pipeline", "flips depend on the worker", """
        import torch.utils.data
        from labkit import loaders
        def _flip_by_worker(seed, epoch, index):
            worker = torch.utils.data.get_worker_info()
            return worker is not None and worker.id == 0
        loaders.flip_decision = _flip_by_worker
    """, fails_at="cell-28", says="do not depend on the worker count",
             needs=('cell-01', 'cell-05', 'cell-27'), alone=False),
    Sabotage("01_input_pipeline", "the transformed cache decodes the JPEGs again every epoch", """
        from labkit import ladder
        _build = ladder.Ladder.transformed_cache
        def _cache_that_decodes(self):
            _, cache = _build(self)
            return self.files(rung="transformed cache"), cache
        ladder.Ladder.transformed_cache = _cache_that_decodes
    """, fails_at="cell-17b", says="removes the conversion bottleneck",
             needs=("cell-01", "cell-05", "cell-03", "cell-10", "cell-17")),
    Sabotage("01_input_pipeline", "the transformed cache is read from the page cache, not the disk", """
        from labkit import pagecache
        pagecache.drop = lambda path: True
    """, fails_at="cell-17b", says="each epoch reads the cache file from the disk",
             needs=("cell-01", "cell-05", "cell-03", "cell-17"), trim=TRIM_LAB1_STAND_IN, alone=False),
    Sabotage("01_input_pipeline", "the columnar Parquet reader converts row by row", """
        from labkit import arrow_conversion
        arrow_conversion.CONVERSIONS["columnar"] = arrow_conversion.rowwise
    """, fails_at="parquet-assert", says="viewing the columns removes the per-row conversion",
             needs=("cell-01", "cell-05", "cell-03", "cell-07", "parquet-run"),
             trim=TRIM_LAB1_STAND_IN + TRIM_LAB1_SMALL_PARQUET),
    Sabotage("01_input_pipeline", "the Parquet slice is stored at 8 px, a quarter of the training resolution", """
        from PIL import Image
        from labkit import arrow_conversion
        class _StoredSmall:
            BILINEAR, fromarray = Image.BILINEAR, staticmethod(Image.fromarray)
            @staticmethod
            def open(path):
                return Image.open(path).convert("RGB").resize((8, 8), Image.BILINEAR)
        arrow_conversion.Image = _StoredSmall
        _write = arrow_conversion.write_slice
        arrow_conversion.write_slice = lambda paths, labels, target, **kwargs: _write(
            paths, labels, str(target) + ".8px", **kwargs)
    """, fails_at="parquet-assert", says="converting is the row-wise reader's largest stage",
             needs=("cell-01", "cell-05", "cell-03", "cell-07", "parquet-run"),
             trim=TRIM_LAB1_STAND_IN + TRIM_LAB1_SMALL_PARQUET),
    Sabotage("01_input_pipeline", "the Parquet reader converts the whole epoch while the first batch is awaited", """
        from labkit import arrow_conversion
        _iter = arrow_conversion.ParquetBatches.__iter__
        def _whole_epoch_first(self):
            yield from list(_iter(self))   # the wait lands on the first step, which the meter leaves out
        arrow_conversion.ParquetBatches.__iter__ = _whole_epoch_first
    """, fails_at="parquet-assert", says="the row-wise conversion still starves the accelerator",
             needs=("cell-01", "cell-05", "cell-03", "cell-07", "parquet-run")),
    Sabotage("01_input_pipeline", "the columnar Parquet reader also converts every row as it reads", """
        from labkit import arrow_conversion
        _columnar = arrow_conversion.columnar
        def _columnar_with_rows(table, log, **kwargs):
            with log.timing("read"):   # the row-wise reader's whole work, booked as reading
                arrow_conversion.rowwise(table, arrow_conversion.ReaderLog(), **kwargs)
            return _columnar(table, log, **kwargs)
        arrow_conversion.CONVERSIONS["columnar"] = _columnar_with_rows
    """, fails_at="parquet-assert", says="the columnar reader narrows the gap",
             needs=("cell-01", "cell-05", "cell-03", "cell-07", "parquet-run")),
    Sabotage("01_input_pipeline", "the columnar Parquet reader keeps the tensors it converted in an earlier epoch", """
        from labkit import arrow_conversion, ladder
        _iter, _kept = arrow_conversion.ParquetBatches.__iter__, {}
        def _iter_keeping(self):
            key = (str(self.path), self.convert.__name__, self.epoch)
            if key in _kept:
                for batch in _kept[key]:
                    self.log.delivered(batch)
                    yield batch
                return
            _kept[key] = []
            for batch in _iter(self):
                _kept[key].append(batch)
                yield batch
        arrow_conversion.ParquetBatches.__iter__ = _iter_keeping
        _parquet = ladder.Ladder.parquet
        def _columnar_twice(self, conversion):
            if conversion == "columnar":
                _parquet(self, conversion)   # an earlier epoch fills what the reader keeps
            return _parquet(self, conversion)
        ladder.Ladder.parquet = _columnar_twice
    """, fails_at="cell-17b", says="the transformed cache removes what the columnar reader still repeats",
             needs=("cell-01", "cell-05", "cell-03", "cell-07", "cell-10", "parquet-run", "cell-17"),
             trim=TRIM_LAB1_SMALL_PARQUET),
    Sabotage("01_input_pipeline", "the slice 'in RAM' is decoded from the files every epoch", """
        from labkit import ladder
        ladder.Ladder.in_ram = lambda self: self.files(rung="in RAM")
    """, fails_at="cell-08", says="with data in RAM the accelerator should be busy"),
    Sabotage("01_input_pipeline", "the loader ignores its workers and decodes in the training loop", """
        from labkit import loaders
        _file_loader = loaders.file_loader
        loaders.file_loader = lambda *args, num_workers=0, **kwargs: _file_loader(*args, num_workers=0, **kwargs)
    """, fails_at="cell-23", says="workers overlap decoding with compute",
             needs=("cell-01", "cell-05", "cell-03", "cell-07", "cell-22")),
    Sabotage("01_input_pipeline", "draft decode skips the decode and feeds the transformed cache's tensors", """
        from labkit import ladder
        _files, _cache = ladder.Ladder.files, ladder.Ladder.transformed_cache
        def _draft_from_the_cache(self, *, draft=False, **kwargs):
            return _cache(self)[0] if draft else _files(self, **kwargs)
        ladder.Ladder.files = _draft_from_the_cache
    """, fails_at="draft-assert", says="decoding less still leaves the accelerator waiting",
             needs=("cell-01", "cell-05", "cell-03", "cell-17", "draft-run")),
    Sabotage("01_input_pipeline", "the loader's workers take turns on the store, one GET at a time", """
        import multiprocessing
        from labkit import objectstore
        _get, _one_at_a_time = objectstore.HttpFetch.get, multiprocessing.Lock()   # forked workers share it
        def _get_in_turn(self, url, byte_range=None):
            with _one_at_a_time:
                return _get(self, url, byte_range)
        objectstore.HttpFetch.get = _get_in_turn
    """, fails_at="cell-12b", says="GETs in flight", needs=("cell-01", "cell-05", "cell-03", "cell-12"),
             trim=TRIM_LAB1_STAND_IN),
    Sabotage("01_input_pipeline", "the raw cache GETs every object again while it trains", """
        from labkit import loaders
        _fill = loaders.RawCache.fill.__func__
        def _fill_and_keep_the_store(cls, fetch, count, **kwargs):
            cache = _fill(cls, fetch, count, **kwargs)
            cache.fetch = fetch
            return cache
        loaders.RawCache.fill = classmethod(_fill_and_keep_the_store)
        loaders.RawCache.__call__ = lambda self, index: self.fetch(index)
    """, fails_at="cell-15", says="training from it asks the store for nothing",
             needs=("cell-01", "cell-05", "cell-03", "cell-10", "cell-12", "cell-14"),
             trim=TRIM_LAB1_SHORT_LATENCY + TRIM_LAB1_STAND_IN, alone=False),
    Sabotage("01_input_pipeline", "the diagnosis does not recognise a DataLoader's wait", """
        import re
        from labkit import step_attribution
        step_attribution._DATA = re.compile(r"^no loader has this name$")
    """, fails_at="diagnose-asserts-01", says="the file path waits for data",
             needs=("cell-01", "cell-05", "cell-03", "cell-17", "diagnose-01"), trim=TRIM_LAB1_STAND_IN),
    Sabotage("01_input_pipeline", "the transformed cache's loader decodes the JPEGs again", """
        from labkit import ladder_diagnosis
        _feeds = ladder_diagnosis.feeds
        ladder_diagnosis.feeds = lambda run, cache: {name: _feeds(run, cache)["files"] for name in _feeds(run, cache)}
    """, fails_at="diagnose-asserts-01", says="the transformed cache cuts the data share",
             needs=("cell-01", "cell-05", "cell-03", "cell-17", "diagnose-01"), trim=TRIM_LAB1_STAND_IN),
    Sabotage("01_input_pipeline", "the step meter leaves the loader's wait off its clock", """
        import contextlib
        from labkit import meter
        @contextlib.contextmanager
        def _untimed(self):
            yield
            self.wait_ms.append(0.0)
        meter.StepMeter.waiting = _untimed
    """, fails_at="diagnose-asserts-01", says="agrees with the step meter's waiting share",
             needs=("cell-01", "cell-05", "cell-03", "cell-17", "diagnose-01"), trim=TRIM_LAB1_STAND_IN),
    Sabotage("02_data_engine", "the tensor cache stores JPEG bytes and decodes them every step", """
        from labkit import dataengine, profile, representations
        _px = profile().pick(dataengine.SIZES).image_px
        _packed, _decode = representations.write_packed, representations.packed_batches
        representations.write_tensor_cache = lambda frame, target, image_px: _packed(frame, target)
        representations.cache_batches = lambda path, batch_size: _decode(path, _px, batch_size)
    """, fails_at="5c81458e", says="cache.disk_bytes",
             needs=('ea9b2598', 'ec76baf4', '9134b9d0')),
    Sabotage("02_data_engine", "the tensor cache's feed decodes the JPEG files again", """
        from labkit import dataengine, profile, representations
        _sizes = profile().pick(dataengine.SIZES)
        _files = representations.file_batches
        _selected = []
        _write = representations.write_tensor_cache

        def write_tensor_cache(frame, target, image_px):
            _selected.append(frame)
            return _write(frame, target, image_px)

        representations.write_tensor_cache = write_tensor_cache
        representations.cache_batches = lambda path, batch_size: _files(_selected[-1], _sizes.image_px, batch_size)
    """, fails_at="525158c7", says="it still decodes",
             needs=('ea9b2598', 'ec76baf4', '9134b9d0', '5ba0b5c1', 'ea4635fe', '4feeaa4a', '5c81458e', '4b08e460'),
             alone=True),
    Sabotage("02_data_engine", "torch's resize works in float64 instead of on the uint8 image", """
        import daft
        import numpy as np
        import torch
        import torch.nn.functional as F
        from daft import DataType
        from labkit import dataengine

        def _float_resize(image_px):
            shape = (image_px, image_px, 3)

            @daft.func.batch(return_dtype=DataType.tensor(DataType.uint8(), shape=shape), use_process=False)
            def resize_in_float64(images):
                out = np.empty((len(images), *shape), dtype=np.uint8)
                for row, pixels in enumerate(images.to_pylist()):
                    chw = torch.from_numpy(np.require(pixels, requirements="W")).permute(2, 0, 1)[None].double()
                    small = F.interpolate(chw, size=shape[:2], mode="bilinear", antialias=True)
                    out[row] = small[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()
                return out
            return resize_in_float64
        dataengine.torch_resize = _float_resize
    """, fails_at="5ba0b5c1", says="torch's resize alone costs less CPU than Daft's",
             needs=('ea9b2598', 'ec76baf4', '9134b9d0'), alone=True),
    Sabotage("02_data_engine", "the packed file puts every image in its own row group", """
        from labkit import representations
        _packed = representations.write_packed
        representations.write_packed = lambda frame, target, rows_per_group=128: _packed(frame, target, rows_per_group=1)
    """, fails_at="5c81458e", says="packed.disk_bytes - files.disk_bytes",
             needs=('ea9b2598', 'ec76baf4', '9134b9d0')),
    Sabotage("02_data_engine", "the reader fetches the whole file and filters in memory", """
        import daft
        from labkit import representations
        representations.read_parquet_url = lambda url: daft.from_arrow(daft.read_parquet(url).to_arrow())
    """, fails_at="pushdown-02", says="projection pushdown",
             needs=("ea9b2598", "ec76baf4", "9134b9d0", "5c81458e")),
    Sabotage("02_data_engine", "the engine fetches one object at a time from the store", """
        import daft
        from labkit import dataengine, objectstore, store_race
        _batches = store_race._batches
        def _one_at_a_time(loader, urls, labels, **sizes):
            if loader != "Daft pipeline":
                return _batches(loader, urls, labels, **sizes)
            jpegs = [objectstore.HttpFetch([url])(0) for url in urls]   # one GET in flight at a time
            frame = daft.from_pydict({"jpeg": jpegs, "label": list(labels)})
            return dataengine.torch_batches(
                dataengine.decode_pipeline(frame, sizes["image_px"], bytes_column="jpeg"), sizes["batch_size"])
        store_race._batches = _one_at_a_time
    """, fails_at="race-asserts-02", says="the engine delivers more images/s than the loader",
             needs=("ea9b2598", "ec76baf4", "9134b9d0", "race-02"), trim=TRIM_LAB2_SHORT_RACE),
    Sabotage("02_data_engine", "the loader's GET threads take turns, one request at a time", """
        import threading
        from labkit import objectstore
        _get, _one_at_a_time = objectstore.HttpFetch.get, threading.Lock()   # each worker's threads share it
        def _get_in_turn(self, url, byte_range=None):
            with _one_at_a_time:
                return _get(self, url, byte_range)
        objectstore.HttpFetch.get = _get_in_turn
    """, fails_at="race-asserts-02", says="GET threads keep more requests in flight",
             needs=("ea9b2598", "ec76baf4", "9134b9d0", "race-02"), trim=TRIM_LAB2_SHORT_RACE),
    Sabotage("02_data_engine", "the materialised column keeps the JPEG bytes and decodes on access", """
        from pathlib import Path
        from labkit import catalog
        from labkit.devices import PeakRss
        _peaks = catalog.decode_peaks
        def _lazy(paths, *, batch=32):
            paths = list(paths)
            with PeakRss() as kept:
                column = [Path(path).read_bytes() for path in paths]   # decoded only when a row is read
            measured = _peaks(paths, batch=batch)
            return catalog.DecodePeaks(measured.jpeg_bytes, measured.decoded_bytes, kept.added_bytes,
                                       measured.streamed_bytes)
        catalog.decode_peaks = _lazy
    """, fails_at="memory-asserts-02", says="kept decoded images take their decoded bytes in memory",
             needs=("ea9b2598", "ec76baf4", "8b8492e9", "memory-02")),
    Sabotage("02_data_engine", "the decode counts the JPEG's bytes instead of decoding it", """
        import os
        from labkit import catalog
        catalog.decoded_bytes = lambda paths: sum(os.path.getsize(p) for p in paths)
    """, fails_at="8b8492e9", says="the catalog's sizes describe the decoded images",
             needs=("ea9b2598", "ec76baf4")),
    Sabotage("03_memory_movement", "the fused chain runs op by op", """
        import torch
        from labkit import fusion
        fusion.fused_chain = lambda method, hidden, dtype: (
            lambda x, bias, residual, scale, out: fusion.unfused_chain(x, bias, residual, scale, out, torch.empty_like(x)))
    """, fails_at="cd563271", says="fused",
             needs=('acb2cc6c', '2edeefe8')),
    Sabotage("03_memory_movement", "the unfused chain is timed as a no-op that returns its first result", """
        from labkit import fusion
        _unfused, _results = fusion.unfused_chain, {}

        def unfused_chain(x, bias, residual, scale, out, scratch):
            if id(out) not in _results:
                _results[id(out)] = _unfused(x, bias, residual, scale, out, scratch)
            return _results[id(out)]

        fusion.unfused_chain = unfused_chain
    """, fails_at="cd563271", says="more than write-allocate explains",
             needs=('acb2cc6c', '2edeefe8')),
    Sabotage("03_memory_movement", "the working-set sweep always reads the largest array", """
        from labkit import cache_sweep
        _read = cache_sweep.read_bytes_per_s
        cache_sweep.read_bytes_per_s = lambda device, working_set_bytes, **kwargs: _read(device, 64 * 2**20, **kwargs)
    """, fails_at="hierarchy-03", says="in-cache reads were only", needs=('acb2cc6c',)),
    Sabotage("03_memory_movement", "memory-bound ops timed with a fresh output every call", """
        import torch
        from labkit import microbench
        _ops = microbench.transformer_ops
        def _allocating(device, chosen):
            suite = _ops(device, chosen)
            x = torch.randn(chosen.op_numel_rows, chosen.op_numel_cols, device=device)
            y = torch.randn_like(x)
            suite.ops[:2] = [(suite.ops[0][0], lambda: x + y), (suite.ops[1][0], lambda: torch.relu(x))]
            return suite
        microbench.transformer_ops = _allocating
    """, fails_at="0af13c21", says="of the memory roof beside it, not most of it",
             needs=('acb2cc6c', '2edeefe8', 'b3329a8a', '0ca551fd')),
    Sabotage("03_memory_movement", "the multiply-add chain runs op by op", """
        from labkit import fused_intensity
        def _eager(k):
            def chain(x, out):
                out.copy_(x)
                for _ in range(k):
                    out.mul_(0.999).add_(0.001)   # each op a pass over memory
            return chain
        fused_intensity.compiled_chain = _eager
    """, fails_at="slope-asserts-03", says="off the sloped part", needs=('acb2cc6c', '2edeefe8', 'slope-03'),
             trim=TRIM_LAB3_SHORT_CHAINS),
    Sabotage("03_memory_movement", "the overlapped pipeline copies and computes in turn", """
        from labkit import overlap
        overlap.overlapped_pipeline = overlap.serial_pipeline
    """, fails_at="49b5270a", says="concurrent_ms",
             needs=('acb2cc6c',)),
    Sabotage("04_zero_memory", "ZeRO stage 3 keeps the whole optimizer state on every rank", """
        from labkit import zero_probe
        _config = zero_probe.deepspeed_config
        def _stage3_as_stage0(config, **kwargs):
            built = _config(config, **kwargs)
            if built["zero_optimization"]["stage"] == 3:
                built["zero_optimization"]["stage"] = 0
            return built
        zero_probe.deepspeed_config = _stage3_as_stage0
    """, fails_at="a20840b0", says="relative_error",
             needs=('40b7a698', '712e7ac5'), trim=TRIM_LAB4_NO_LINKS),
    Sabotage("04_zero_memory", "checkpointing that keeps every activation", """
        from labkit import recompute
        recompute.checkpointed_forward = recompute.keep_all_forward
    """, fails_at="recompute-asserts", says="checkpointing kept",
             needs=('40b7a698', 'recompute-run')),
    Sabotage("04_zero_memory", "ZeRO stage 3 that keeps every parameter on every rank", """
        from labkit import zero_probe
        _config = zero_probe.deepspeed_config
        def _stage3_as_stage2(config, **kwargs):
            built = _config(config, **kwargs)
            if built["zero_optimization"]["stage"] == 3:
                built["zero_optimization"]["stage"] = 2
            return built
        zero_probe.deepspeed_config = _stage3_as_stage2
    """, fails_at="traffic-asserts", says="sent[s] / backend[s]",
             needs=('40b7a698', '712e7ac5', 'traffic-table'), trim=TRIM_LAB4_BASE_ONLY),
    Sabotage("04_zero_memory", "ZeRO links that are not shaped", """
        from labkit import netns
        netns.shape = lambda *args, **kwargs: None
    """, fails_at="traffic-asserts", says="shorter than its bytes on the link",
             needs=('40b7a698', '712e7ac5', 'traffic-table'), trim=TRIM_LAB4_BASE_ONLY),
    Sabotage("04_zero_memory", "ZeRO stage 3 that partitions nothing, seen at a step's peak", """
        from labkit import zero_probe
        _config = zero_probe.deepspeed_config
        def _stage3_as_stage0(config, **kwargs):
            built = _config(config, **kwargs)
            if built["zero_optimization"]["stage"] == 3:
                built["zero_optimization"]["stage"] = 0
            return built
        zero_probe.deepspeed_config = _stage3_as_stage0
    """, fails_at="whole-asserts", says="stage 3's step peak is not a larger part",
             needs=('40b7a698', '712e7ac5', '0d12ccb3', 'whole-table'), trim=TRIM_LAB4_NO_LINKS),
    Sabotage("05_gradient_sync", "delayed sync that syncs every micro-step", """
        from labkit import gradsync
        gradsync.STEP_FNS["delayed_sync"] = gradsync.sync_every_micro_step
    """, fails_at="1b231abd", says="all_reduce_calls_per_step",
             needs=('861d0932', 'a171f42a'), trim=TRIM_LAB5_RATES.format(rates="max(gradsync.RATES_GBIT),")),
    Sabotage("05_gradient_sync", "a fabric whose links are not shaped", """
        from labkit import netns
        netns.shape = lambda *args, **kwargs: None
    """, fails_at="5c1e0a02", says="measured_over_model",
             needs=('861d0932', 'a171f42a', '1b231abd'),
             trim=TRIM_LAB5_RATES.format(rates="min(gradsync.RATES_GBIT), max(gradsync.RATES_GBIT)")),
    Sabotage("05_gradient_sync", "the diagnosis does not recognise gloo's collectives", """
        import re
        from labkit import step_attribution
        step_attribution._COLLECTIVE = re.compile(r"^no collective has this name$")
    """, fails_at="diagnose-asserts-05", says="syncing every micro-batch on a slow link is communication-bound",
             needs=('861d0932', 'a171f42a', 'diagnose-05'), trim=TRIM_LAB5_RATES.format(rates="0.5,")),
    Sabotage("05_gradient_sync", "the crossover's delayed sync syncs every micro-batch", """
        from labkit import gradsync, gradsync_crossover
        gradsync_crossover.delayed_sync = gradsync.sync_every_micro_step
    """, fails_at="crossover-asserts-05", says="of the ceiling", needs=('861d0932', 'crossover-run-05'),
             trim=TRIM_LAB5_TWO_WINDOWS),
    Sabotage("05_gradient_sync", "DDP ignores its bucket size and all-reduces one bucket when backward ends", """
        from labkit import ddp_overlap
        ddp_overlap.bucket_cap_mb = lambda variant: ddp_overlap.ONE_BUCKET_BYTES / 2**20
    """, fails_at="overlap-asserts-05", says="of the one-bucket wait exposed", needs=('861d0932', 'overlap-run-05')),
    Sabotage("05_gradient_sync", "the overlap's link is not shaped", """
        from labkit import netns
        netns.shape = lambda *args, **kwargs: None
    """, fails_at="overlap-asserts-05", says="the modelled time for the link", needs=('861d0932', 'overlap-run-05')),
    Sabotage("06_quantized_collectives", "hpZ gathers weights across nodes", """
        import torch.distributed as dist
        from labkit import quantcomm
        quantcomm.node_groups = lambda layout: (dist.group.WORLD, list(range(layout.world_size)))
    """, fails_at="bytes-asserts-06", says="stay inside the node",
             needs=("de64dbe2", "fabric-run-06", "bytes-table-06"), trim=TRIM_LAB6_BYTES_ONLY),
    Sabotage("06_quantized_collectives", "qwZ puts fp32 weights on the wire", """
        import torch
        from labkit import quantcomm
        quantcomm.all_gather_quantized = lambda shard, *, group=None, bits=8, block_size=256: (
            quantcomm.all_gather_plain(shard, group=group, comm_dtype=torch.float32))
    """, fails_at="bytes-asserts-06", says="int8 weights on the wire",
             needs=("de64dbe2", "fabric-run-06", "bytes-table-06"), trim=TRIM_LAB6_BYTES_ONLY),
    Sabotage("06_quantized_collectives", "the big micro-batch computes only four samples", """
        from labkit import zeropp
        _batch = zeropp.batch
        zeropp.batch = lambda dims, teacher, size, seed: _batch(dims, teacher, min(size, 4), seed)
    """, fails_at="microbatch-06", says="must shrink with a bigger micro-batch",
             needs=("de64dbe2", "fabric-run-06"), trim=TRIM_LAB6_SLOWEST_RATE, alone=True),
    Sabotage("07_checkpoints_and_fusion", "the async saver blocks until its write ends", ASYNC_SAVE_THAT_WAITS,
             fails_at="d5198ca9", says="the trainer waits for the snapshot, not the write",
             needs=('09780d08', 'plan-k', 'f13536ac')),
    Sabotage("07_checkpoints_and_fusion", "the async saver blocks until its write ends, seen by the diagnosis",
             ASYNC_SAVE_THAT_WAITS, fails_at="diagnose-asserts-07", says="the checkpoint share falls with async saves",
             needs=('09780d08', 'diagnose-07'), trim=TRIM_LAB7_SHORT_DIAGNOSIS, alone=True),
    Sabotage("07_checkpoints_and_fusion", "goodput counted at each run's own step time", """
        import time
        from labkit import checkpoint_stalls as stalls
        stalls.TrainingRun.goodput = lambda self, baseline: self.steps * self.median_step_s / self.end_s
        # the condition it misleads under: a writer that takes the trainer's cores, so that every async step takes
        # twice the slowest step without checkpoints (a slowdown added to each step kept the spread that other work
        # on a busy machine gave the steps, the async run's median fell behind its mean, and the cell passed in
        # 4 of 5 runs here)
        _train, _step = stalls.train_with_checkpoints, stalls.train_step
        _unsaved_s = []
        def _timed_step(*args, **kwargs):
            start = time.perf_counter()
            loss = _step(*args, **kwargs)
            _unsaved_s.append(time.perf_counter() - start)
            return loss
        def _slowed_step(*args, **kwargs):
            start = time.perf_counter()
            loss = _step(*args, **kwargs)
            time.sleep(max(0.0, 2 * max(_unsaved_s) - (time.perf_counter() - start)))
            return loss
        def _train_beside_a_greedy_writer(kind, *args, **kwargs):
            stalls.train_step = {"none": _timed_step, "async": _slowed_step}.get(kind, _step)
            try:
                return _train(kind, *args, **kwargs)
            finally:
                stalls.train_step = _step
        stalls.train_with_checkpoints = _train_beside_a_greedy_writer
    """, fails_at="goodput-07", says="the run that finishes later never scores the higher goodput",
             needs=('09780d08', 'plan-k', 'f13536ac')),
    Sabotage("07_checkpoints_and_fusion", "the restarted trainer fetches from the store although a copy is in memory", """
        from labkit import restore
        _sources = restore._sources
        restore._sources = lambda snapshot, fetch: {source: _sources(snapshot, fetch)["store"]
                                                    for source in ("memory", "store")}
    """, fails_at="restore-asserts-07", says="the in-memory copy restores far faster than the store",
             needs=('09780d08', 'restore-07')),
    Sabotage("07_checkpoints_and_fusion", "the diagnosis leaves saves unlabelled", """
        import contextlib
        from labkit import diagnose
        diagnose._checkpoint_spans = contextlib.nullcontext
    """, fails_at="diagnose-asserts-07", says="the profile's checkpoint share agrees with the loop's clock",
             needs=('09780d08', 'diagnose-07'), trim=TRIM_LAB7_SHORT_DIAGNOSIS),
    Sabotage("07_checkpoints_and_fusion", "the diagnosis labels every step as checkpoint", """
        from labkit import step_attribution
        step_attribution.CHECKPOINT_SPAN = ""
    """, fails_at="diagnose-asserts-07", says="the profile's checkpoint share agrees with the loop's clock",
             needs=('09780d08', 'diagnose-07'), trim=TRIM_LAB7_SHORT_DIAGNOSIS),
    Sabotage("07_checkpoints_and_fusion", "a resume that restarts at step 0", """
        from labkit import checkpoint
        checkpoint.restore_training_state = lambda state, model, optimizer: 0
    """, fails_at="46f16982", says="resumed == uninterrupted",
             needs=('09780d08', '455d5cf1')),
    Sabotage("08_recovery_and_placement", "a NaN loss blamed on the node", """
        from labkit import triage
        triage.node_at_fault = lambda cause: True
    """, fails_at="71cc3d7e", says="a NaN is the program's: the ranks restart on the same nodes",
             needs=('48b1b338', 'fc74298f', '67abeab2', 'dce1689b'), trim=TRIM_LAB8_NAN_ONLY),
    Sabotage("08_recovery_and_placement", "a straggler rule that never fires", """
        from labkit import stragglers
        stragglers.StragglerRule.is_slow = lambda self, own_s, others_s: False
    """, fails_at="straggler-asserts-08", says="the slow rank was caught",
             needs=('48b1b338', '67abeab2', 'straggler-run-08')),
    Sabotage("08_recovery_and_placement", "the supervisor's watch judges twelve steps more than its rule's window", """
        import dataclasses
        from labkit import heartbeat, recovery
        recovery.HeartbeatWatch = lambda rule: heartbeat.HeartbeatWatch(dataclasses.replace(rule, window=rule.window + 12))
    """, fails_at="straggler-asserts-08", says="the rule called it a window of slow steps on",
             needs=('48b1b338', '67abeab2', 'straggler-run-08'), alone=True),
    Sabotage("08_recovery_and_placement", "a threshold set under the drift of healthy ranks", """
        import dataclasses
        from labkit import stragglers
        stragglers.calibrated = lambda healthy, base=stragglers.StragglerRule(): dataclasses.replace(base, factor=1.001)
    """, fails_at="straggler-asserts-08", says="no healthy rank was called slow",
             needs=('48b1b338', '67abeab2', 'straggler-run-08')),
    Sabotage("08_recovery_and_placement", "the loops' clocks leave out their saves", """
        from labkit import interval_runs
        _advance = interval_runs._Loop.advance

        def advance(self):
            saving = self.save_s
            _advance(self)
            self.elapsed_s -= self.save_s - saving

        interval_runs._Loop.advance = advance
    """, fails_at="interval-order-08", says="goodput peaks at the middle interval",
             needs=('48b1b338', 'interval-run-08'), trim=TRIM_LAB8_FAILURES.format(failures=8, share=1.0), alone=True),
    Sabotage("08_recovery_and_placement", "useful work timed on a baseline that saves too", """
        from labkit import interval_runs
        _init = interval_runs._Loop.__init__
        interval_runs._Loop.__init__ = lambda self, sizes, interval_s, *rest: _init(self, sizes, interval_s or 0.005, *rest)
    """, fails_at="interval-asserts-08", says="measured goodput within",
             needs=('48b1b338', 'interval-run-08'), trim=TRIM_LAB8_FAILURES.format(failures=4, share=0.5), alone=True),
    Sabotage("08_recovery_and_placement", "a reload that restores the model but not the optimizer's moments", """
        from labkit import interval_runs
        _load = interval_runs._Trainer.load

        def load(sizes, path):
            trainer, position = _load(sizes, path)
            trainer.optimizer.state.clear()
            return trainer, position

        interval_runs._Trainer.load = staticmethod(load)
    """, fails_at="interval-asserts-08", says="every loop ended on the same weights",
             needs=('48b1b338', 'interval-run-08'), trim=TRIM_LAB8_FAILURES.format(failures=4, share=0.5), alone=True),
    Sabotage("08_recovery_and_placement", "torchrun without restarts", """
        from labkit import elastic
        _run_torchrun = elastic.run_torchrun
        elastic.run_torchrun = lambda *args, **kwargs: _run_torchrun(*args, **{**kwargs, "max_restarts": 0})
    """, fails_at="elastic-asserts-08", says="torchrun restarted the job once",
             needs=('48b1b338', 'fc74298f', '67abeab2', 'dce1689b', 'elastic-run-08'), trim=TRIM_LAB8_KILL_ONLY),
    Sabotage("08_recovery_and_placement", "zone links that are not shaped", """
        from labkit import netns
        netns.shape = lambda *args, **kwargs: None
    """, fails_at="placement-measure-asserts", says="the shaped rate",
             needs=('48b1b338', 'placement-measure')),
    Sabotage("08_recovery_and_placement", "zone packing that places jobs anywhere", """
        from labkit import placement
        _place = placement._place
        placement._place = lambda state, policy, gpus, zone_capacity_gpus: _place(
            state, "first-fit-anywhere", gpus, zone_capacity_gpus)
    """, fails_at="e4378be9", says="mean_completion_h",
             needs=("48b1b338", "placement-measure", "placement-links", "1a9a10fa"), trim=TRIM_LAB8_ASSUMED_LINKS),
    Sabotage("07_checkpoints_and_fusion", "the fused loss materialises the full logits", """
        from labkit import fused_loss
        fused_loss.fused_linear_cross_entropy = (
            lambda hidden, weight, targets, **kwargs: fused_loss.unfused_linear_cross_entropy(hidden, weight, targets))
    """, fails_at="c36eea73", says="peaks[\"fused\"].peak_bytes",
             needs=('09780d08', '9841b9d6', '9de5ef04')),
]


_AFTER_LABKIT = """
import importlib.util
import sys

CODE = {code!r}


class _BreakLabkitOnImport:
    \"\"\"Run CODE once the labkit package is imported, before any of its modules that CODE breaks.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name != "labkit":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_break(module):
            exec_module(module)
            exec(compile(CODE, "<sabotage>", "exec"), {{"__name__": "__sabotage__"}})

        spec.loader.exec_module = exec_then_break
        return spec


sys.meta_path.insert(0, _BreakLabkitOnImport())
"""


def _sitecustomize(folder: Path, code: str) -> dict[str, str]:
    """Environment for the kernel: ``code`` runs in every Python process it spawns that imports labkit.

    It runs right after the ``labkit`` package itself is imported, so processes that
    never import labkit (DeepSpeed starts ~14 ``cpuinfo`` probes per Lab 4 run) skip
    it: running it in every process cost Lab 4's sabotages ~25 s each.
    """
    (folder / "sitecustomize.py").write_text(_AFTER_LABKIT.format(code=code))
    path = os.pathsep.join([str(folder), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path}


def chosen_cells(notebook: str, first_cell: str, last_cell_id: str,
                 needs: tuple[str, ...] = ()) -> nbformat.NotebookNode:
    """The notebook cut to ``first_cell``, then ``needs`` (or every cell before ``last_cell_id``), then that cell."""
    nb = nbformat.read(notebooks_dir() / f"{notebook}.ipynb", as_version=4)
    ids = [cell.get("id") for cell in nb.cells]
    missing = [cell_id for cell_id in (*needs, last_cell_id) if cell_id not in ids]
    if missing:
        raise ValueError(f"{notebook} has no cells {missing}; its cells are {ids}")
    chosen = nb.cells[: ids.index(last_cell_id) + 1]
    if needs:
        chosen = [cell for cell in chosen if cell.get("id") in {*needs, last_cell_id}]
    nb.cells = [nbformat.v4.new_code_cell(first_cell)] + chosen
    return nb


def execute(nb: nbformat.NotebookNode, env: dict[str, str]) -> None:
    """Run ``nb`` in a fresh kernel with ``env`` added, exercises unanswered; raises CellExecutionError.

    The kernel is forked from a process that has imported torch already (see tests/forked_kernels.py).
    """
    saved = dict(os.environ)
    os.environ.update({"LABKIT_SOLUTIONS": "0", **env})   # exercise cells only print what they wait for
    try:
        NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", shutdown_kernel="immediate",
                       kernel_manager_class=ForkedKernelManager,
                       resources={"metadata": {"path": str(notebooks_dir())}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_until(notebook: str, first_cell: str, last_cell_id: str, env: dict[str, str],
              needs: tuple[str, ...] = ()) -> tuple[str | None, str]:
    """Run ``first_cell``, then ``needs`` (or every cell before ``last_cell_id``), then that cell.

    Returns the id of the first cell that failed (None if none did) and the error text.
    """
    nb = chosen_cells(notebook, first_cell, last_cell_id, needs)
    try:
        execute(nb, env)
    except CellExecutionError as exc:
        failed = next(cell for cell in nb.cells
                      if any(out.get("output_type") == "error" for out in cell.get("outputs", [])))
        return failed.get("id"), str(exc)
    return None, ""


@pytest.fixture(autouse=True, scope="module")
def _kernel_zygote_stopped_at_the_end():
    yield
    close_zygote()


ALONE_LABS = ("01_input_pipeline", "03_memory_movement")
"""Labs whose sabotages run alone (marked ``alone``, see conftest.py), as their notebooks do, unless a
sabotage says otherwise (``Sabotage.alone``). Lab 1 sizes its stand-in accelerator on a core of its own and
compares rungs by images/s, and Lab 3 measures memory bandwidth, which both cores share: a test beside either
moves what they compare. Run two at a time, Lab 3's sabotage that times ops with a fresh output every call
once failed on an op over a roof measured low (one of five runs), and two of Lab 1's passed an assert they
break (one run). Lab 8's interval experiment sets its failure rate, and so its length, from a save timed
before the runs: beside other tests its sabotage whose loops' clocks leave out their saves took 11-67 s in
ten runs of the first part (13-18 s in three runs alone)."""


def _marked(sabotage: Sabotage):
    alone = sabotage.notebook in ALONE_LABS if sabotage.alone is None else sabotage.alone
    return pytest.param(sabotage, marks=pytest.mark.alone) if alone else sabotage


def check(sabotage: Sabotage, folder: Path) -> None:
    """Run the sabotaged lab up to its failing cell: that cell, and no earlier one, fails on the named assert."""
    code = _first_cell(sabotage.code, sabotage.trim)
    failed_cell, error = run_until(sabotage.notebook, code, sabotage.fails_at, _sitecustomize(folder, code),
                                   sabotage.needs)
    assert failed_cell is not None, f"{sabotage.name}: every cell up to {sabotage.fails_at} passed"
    assert failed_cell == sabotage.fails_at, f"{sabotage.name}: cell {failed_cell} failed first:\n{error[-1500:]}"
    assert "AssertionError" in error, error[-1500:]
    assert sabotage.says in _failing_assert(error), f"another assert failed:\n{error[-1500:]}"


def _sabotage_class(name: str, labs: tuple[str, ...]) -> type:
    """The test class of the sabotages of ``labs`` (notebook prefixes).

    One class per lab: ``pytest -n 2 --dist loadscope`` keeps a class on one worker, so two sabotages of
    one lab never run at once. That began when they shared the lab's working folder under ``LABKIT_DATA``
    and a Lab 7 sabotage read a checkpoint another had just removed (HTTP 404 from its store); each run now
    has a folder of its own (:func:`labkit.paths.run_dir`), and the grouping stays as the suite was timed.
    Labs 7 and 8 share a class, the first to start: both time fsynced saves.
    """

    class Sabotages:
        @pytest.mark.slow
        @pytest.mark.parametrize("sabotage", [_marked(s) for s in SABOTAGES if s.notebook.startswith(labs)],
                                 ids=lambda s: f"{s.notebook[:2]}-{s.name}")
        def test_a_broken_mechanism_fails_the_labs_own_assert(self, sabotage: Sabotage, tmp_path):
            check(sabotage, tmp_path)

    Sabotages.__name__ = Sabotages.__qualname__ = name
    return Sabotages


TestLabs07And08 = _sabotage_class("TestLabs07And08", ("07", "08"))
TestLab01, TestLab02, TestLab03, TestLab04, TestLab05, TestLab06 = (
    _sabotage_class(f"TestLab{number:02d}", (f"{number:02d}",)) for number in range(1, 7))


def _first_cell(*parts: str) -> str:
    return "".join(textwrap.dedent(part).strip() + "\n" for part in parts if part.strip())


def _failing_assert(error: str) -> str:
    """The traceback's arrowed source line and the AssertionError's message, without colour codes."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", error)
    arrowed = [line for line in plain.splitlines() if re.match(r"\s*-+>", line)]
    message = [line for line in plain.splitlines() if line.startswith("AssertionError")]
    return "\n".join(arrowed[-1:] + message[-1:])


def test_the_failing_assert_is_read_from_the_traceback():
    error = ("\x1b[31mAssertionError\x1b[39m   Traceback (most recent call last)\nCell In[13], line 9\n"
             "\x1b[32m----> \x1b[39m\x1b[32m9\x1b[39m \x1b[38;5;28;01massert\x1b[39;00m fused.fused_ms < fused.unfused_ms\n"
             "\x1b[31mAssertionError\x1b[39m: slower\n")
    assert _failing_assert(error) == "----> 9 assert fused.fused_ms < fused.unfused_ms\nAssertionError: slower"


def check_trims_alone(folder: Path, notebooks: tuple[str, ...] = ()) -> None:
    """Run each distinct trim without its sabotage: its failing cell must pass (no test: it costs minutes)."""
    seen = set()
    for sabotage in SABOTAGES:
        if notebooks and not sabotage.notebook.startswith(notebooks):
            continue
        if not sabotage.trim or (sabotage.notebook, sabotage.trim, sabotage.fails_at) in seen:
            continue
        seen.add((sabotage.notebook, sabotage.trim, sabotage.fails_at))
        code = _first_cell(sabotage.trim)
        failed_cell, error = run_until(sabotage.notebook, code, sabotage.fails_at, _sitecustomize(folder, code),
                                       sabotage.needs)
        print(f"{sabotage.notebook} up to {sabotage.fails_at}, trimmed for {sabotage.name!r}: "
              + ("passes" if failed_cell is None else f"FAILS at {failed_cell}:\n{error[-1500:]}"), flush=True)


if __name__ == "__main__":
    import sys
    import tempfile

    if sys.argv[1:2] != ["--trims-only"]:
        sys.exit("usage: python -m tests.test_sabotage --trims-only [NOTEBOOK_PREFIX ...]")
    with tempfile.TemporaryDirectory() as folder:
        try:
            check_trims_alone(Path(folder), tuple(sys.argv[2:]))
        finally:
            close_zygote()
            # The kernels were killed at shutdown, so their fork servers' folders stay; pytest's session sweeps
            # them (conftest.py), and so does this run.
            from labkit.launcher import remove_stale_dirs

            remove_stale_dirs()
