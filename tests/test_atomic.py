"""Lab 7: a folder replaced while someone reads it is always there and always whole."""

from __future__ import annotations

import threading

import pytest

from labkit import atomic

_FILES = ("a", "b", "c")


def _fill(folder, version: int) -> None:
    for name in _FILES:
        (folder / name).write_text(f"{version}\n" * 1000)


def _read_until(target, stop: threading.Event, problems: list[str]) -> int:
    """Each read looks every file up through ``target``: none may be missing or torn.

    (Not a directory listing: a listing that opened the old folder just before the
    swap goes on reading it while it is deleted, which is the old folder's fate, not
    the target's.)"""
    reads = 0
    while not stop.is_set():
        reads += 1
        for name in _FILES:
            try:
                lines = (target / name).read_text().splitlines()
            except FileNotFoundError as exc:
                problems.append(f"read {reads}: {exc}")
                continue
            if len(lines) != 1000 or len(set(lines)) != 1:
                problems.append(f"read {reads}: {name} is torn ({len(lines)} lines, {sorted(set(lines))[:3]})")
    return reads


def test_a_reader_never_sees_the_folder_missing_or_partial_while_it_is_replaced(tmp_path):
    (tmp_path / "probe-a").mkdir(), (tmp_path / "probe-b").mkdir()
    if not atomic._exchange(tmp_path / "probe-a", tmp_path / "probe-b"):
        pytest.skip("this file system cannot exchange two folders; the documented fallback has a window")
    (tmp_path / "probe-a").rmdir(), (tmp_path / "probe-b").rmdir()
    target = tmp_path / "dataset"
    with atomic.atomic_directory(target) as tmp:
        _fill(tmp, 0)
    stop, problems = threading.Event(), []
    reader = threading.Thread(target=_read_until, args=(target, stop, problems))
    reader.start()
    # 100 replacements: with the exchange broken (the fallback's rename aside) the reader saw the folder
    # missing 33-321 times in ten tries; each replacement fsyncs, which beside other tests' writes took 14 s for 300
    try:
        for version in range(1, 100):
            with atomic.atomic_directory(target) as tmp:
                _fill(tmp, version)
    finally:
        stop.set()
        reader.join()
    assert problems == [], f"{len(problems)} bad reads, first: {problems[:3]}"
    assert (target / "a").read_text().splitlines()[0] == "99"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"], "the old folders are gone"


def test_without_an_atomic_exchange_the_replacement_still_completes(tmp_path, monkeypatch):
    """Where the file system cannot swap two folders, the old one is renamed aside for
    two renames' time: the documented fallback, never a half-written folder."""
    monkeypatch.setattr(atomic, "_exchange", lambda new, old: False)
    target = tmp_path / "dataset"
    for version in range(3):
        with atomic.atomic_directory(target) as tmp:
            _fill(tmp, version)
    assert (target / "c").read_text().splitlines()[0] == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]


def test_an_interrupted_replacement_keeps_the_old_folder_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "dataset"
    with atomic.atomic_directory(target) as tmp:
        _fill(tmp, 1)
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic.atomic_directory(target) as tmp:
            _fill(tmp, 2)
            raise RuntimeError("interrupted")
    assert (target / "a").read_text().splitlines()[0] == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]
