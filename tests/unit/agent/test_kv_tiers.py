"""The prefix cache's second tier (agent/kv_tiers.py): blocks come back exactly as put, from host
memory or from disk (also in a new store over the same folder: a restart), each tier stays within
its bytes evicting least recently used first, and a file that is truncated, corrupt, of another
model or of another layout is ignored and counted, never returned. The disk tier is this user's
alone (folders 0700, files 0600 from their creation, whatever the umask), follows no symbolic link,
refuses a folder that is a link or another user's, and starts whatever a planted file holds; each
report names the keys the store let go since the previous one."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import stat
import struct
import threading

import numpy as np
import pytest

from agent.contract.step_reply import MAX_REPORTED_EVICTIONS
from agent.kv_tiers import FORMAT_VERSION, MAGIC, SUFFIX, KVLayout, KVTierStore
from time_limit import deadline

LAYOUT = KVLayout(
    layers=2, kv_heads=2, head_dim=4, row_width=4, block_size=4, dtype="float16", kernel_layout="paged"
)
BLOCK = LAYOUT.nbytes  # 2*2*2*4*4 * 2 bytes = 256
MODEL = "weights-sha256:abc"


def key(i: int) -> str:
    return f"{i:016x}"


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(LAYOUT.shape).astype(LAYOUT.dtype)


def disk_store(folder, host_blocks=0, disk_blocks=8, **kwargs) -> KVTierStore:
    args = dict(layout=LAYOUT, model_identity=MODEL, host_bytes=host_blocks * BLOCK)
    args.update(kwargs)
    # a file is the block plus its header (265 bytes here): bound by whole files, with less than
    # one file to spare
    return KVTierStore(disk_bytes=disk_blocks * (BLOCK + 300), disk_dir=folder, **args)


def test_host_tier_returns_blocks_as_put_and_evicts_least_recently_used():
    store = KVTierStore(LAYOUT, MODEL, host_bytes=3 * BLOCK)
    for i in range(3):
        store.put(key(i), block(i))
    assert np.array_equal(store.get(key(0)), block(0))  # 0 is now the most recently used
    store.put(key(3), block(3))  # over the bound: 1 goes, the least recently used
    assert store.keys() == {key(0), key(2), key(3)}
    assert store.get(key(1)) is None and store.host_used == 3 * BLOCK
    assert store.recent_keys(2) == [key(3), key(0)]
    assert store.counts["host_hits"] == 1 and store.counts["misses"] == 1


def test_put_copies_the_block():
    store = KVTierStore(LAYOUT, MODEL, host_bytes=BLOCK)
    buffer = block(1)
    store.put(key(1), buffer)
    buffer[:] = 0  # the caller reuses its buffer
    assert np.array_equal(store.get(key(1)), block(1))


def test_a_block_of_another_shape_or_a_bad_key_is_refused():
    store = KVTierStore(LAYOUT, MODEL, host_bytes=4 * BLOCK)
    with pytest.raises(ValueError, match="float16"):
        store.put(key(1), block(1).astype(np.float32))
    with pytest.raises(ValueError, match="hex"):
        store.put("../../etc/passwd", block(1))
    with pytest.raises(ValueError, match="hex"):
        store.get("ABCDEF0123")


def test_disk_tier_survives_a_restart(tmp_path):
    store = disk_store(tmp_path, host_blocks=2)
    for i in range(4):
        store.put(key(i), block(i))
    store.flush()
    store.close()
    again = disk_store(tmp_path)  # a new process: its host memory is empty
    assert again.keys() == {key(i) for i in range(4)}
    for i in range(4):
        assert np.array_equal(again.get(key(i)), block(i))
    assert again.counts["disk_hits"] == 4 and again.counts["ignored_files"] == 0


def test_disk_tier_stays_within_its_bytes_least_recently_used_first(tmp_path):
    store = disk_store(tmp_path, disk_blocks=3)
    for i in range(3):
        store.put(key(i), block(i))
    store.flush()
    assert store.get(key(0)) is not None  # read back: 0 is now the most recently used
    store.put(key(3), block(3))
    store.flush()
    assert store.keys() == {key(0), key(2), key(3)}
    assert sorted(p.stem for p in tmp_path.glob(f"*{SUFFIX}")) == sorted(store.keys())
    assert store.disk_used <= store.disk_bytes and store.counts["evicted"] == 1
    store.close()
    # recency is kept on disk too: after a restart the least recently used still goes first
    again = disk_store(tmp_path, disk_blocks=3)
    again.put(key(4), block(4))
    again.flush()
    assert again.keys() == {key(0), key(3), key(4)}


def write_then_damage(tmp_path, damage) -> KVTierStore:
    store = disk_store(tmp_path)
    store.put(key(1), block(1))
    store.put(key(2), block(2))
    store.flush()
    store.close()
    damage(tmp_path / f"{key(1)}{SUFFIX}")
    return store


def truncate(path):
    path.write_bytes(path.read_bytes()[:-10])


def flip_a_payload_byte(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def garbage(path):
    path.write_bytes(b"not a block at all")


@pytest.mark.parametrize("damage", [truncate, garbage])
def test_a_truncated_or_foreign_format_file_is_ignored_at_start(tmp_path, damage):
    write_then_damage(tmp_path, damage)
    again = disk_store(tmp_path)
    assert again.keys() == {key(2)} and again.counts["ignored_files"] == 1
    assert again.get(key(1)) is None


def test_a_corrupt_payload_is_ignored_on_load_and_never_returned(tmp_path):
    write_then_damage(tmp_path, flip_a_payload_byte)
    again = disk_store(tmp_path)
    assert key(1) in again  # the header is fine: the checksum is checked when it is read
    assert again.get(key(1)) is None
    assert again.counts["ignored_files"] == 1 and key(1) not in again
    assert not (tmp_path / f"{key(1)}{SUFFIX}").exists()
    assert np.array_equal(again.get(key(2)), block(2))


def test_files_of_another_model_or_layout_are_ignored(tmp_path):
    write_then_damage(tmp_path, lambda path: None)
    other_model = disk_store(tmp_path, model_identity="weights-sha256:def")
    assert other_model.keys() == set() and other_model.counts["ignored_files"] == 2
    other_layout = dataclasses.replace(LAYOUT, kernel_layout="contiguous")
    assert disk_store(tmp_path, layout=other_layout).keys() == set()
    other_dtype = dataclasses.replace(LAYOUT, dtype="float32")
    assert disk_store(tmp_path, layout=other_dtype).keys() == set()
    # left in place: they are valid for their own model
    assert disk_store(tmp_path).keys() == {key(1), key(2)}


def test_a_full_write_queue_drops_and_counts(tmp_path, monkeypatch):
    store = disk_store(tmp_path, host_blocks=8, queue_blocks=1)
    # a slow disk (the one fault stood in for): the writer waits until the puts are done
    disk_free, write = threading.Event(), store._write
    monkeypatch.setattr(store, "_write", lambda *item: (disk_free.wait(10), write(*item)))
    for i in range(4):
        store.put(key(i), block(i))
    disk_free.set()
    store.flush()
    assert store.counts["dropped_writes"] >= 2
    on_disk = {p.stem for p in tmp_path.glob(f"*{SUFFIX}")}
    assert store.counts["written"] == len(on_disk) == 4 - store.counts["dropped_writes"]
    assert all(np.array_equal(store.get(key(i)), block(i)) for i in range(4))  # host memory still has them


def test_drop_forgets_both_tiers(tmp_path):
    store = disk_store(tmp_path, host_blocks=2)
    for i in range(3):
        store.put(key(i), block(i))
    assert store.drop() == 3
    assert store.keys() == set() and not list(tmp_path.glob(f"*{SUFFIX}"))
    assert disk_store(tmp_path).keys() == set()


def test_a_report_counts_since_the_previous_one_and_gives_the_bytes_held(tmp_path):
    store = disk_store(tmp_path, host_blocks=2)
    nbytes = LAYOUT.nbytes
    store.put(key(1), block(1))
    store.flush()
    first = store.report(0.5)
    assert first.counts["written"] == 1 and first.counts["host_hits"] == 0
    assert first.host_bytes == nbytes and first.disk_bytes > nbytes and first.restore_s == 0.5
    store.get(key(1))
    store.get(key(2))
    second = store.report(0.0)
    assert second.counts["written"] == 0  # reported already
    assert second.counts["host_hits"] == 1 and second.counts["misses"] == 1
    store.drop()
    assert store.report(0.0).host_bytes == store.report(0.0).disk_bytes == 0


def test_get_many_reads_side_by_side_in_order_and_skips_what_it_cannot_load(tmp_path):
    write_then_damage(tmp_path, flip_a_payload_byte)
    again = disk_store(tmp_path)
    for i in range(3, 9):
        again.put(key(i), block(i))
    again.flush()
    asked = [key(i) for i in (5, 1, 2, 9, 8, 3, 4, 6, 7)]
    got = again.get_many(asked)
    assert got[1] is None and got[3] is None  # corrupt; never held
    assert all(np.array_equal(g, block(int(k, 16))) for k, g in zip(asked, got) if g is not None)
    assert sum(g is not None for g in got) == 7
    assert again.counts["disk_hits"] == 7 and again.counts["misses"] == 2
    again.close()


def test_files_of_an_earlier_format_are_removed_at_start_and_others_kept(tmp_path):
    write_then_damage(tmp_path, lambda path: None)
    old = tmp_path / f"{key(1)}{SUFFIX}"
    data = old.read_bytes()
    version = f'"version": {FORMAT_VERSION}'.encode()
    old.write_bytes(data.replace(version, f'"version": {FORMAT_VERSION - 1}'.encode(), 1))
    (tmp_path / f"{key(3)}{SUFFIX}").write_bytes(b"not ours")
    again = disk_store(tmp_path)
    assert again.keys() == {key(2)} and again.counts["ignored_files"] == 2
    assert not old.exists() and (tmp_path / f"{key(3)}{SUFFIX}").exists()


def test_a_block_put_again_keeps_the_copy_held():
    store = KVTierStore(LAYOUT, "weights-sha256:abc", host_bytes=4 * LAYOUT.nbytes)
    store.put(key(1), block(1))
    store.put(key(1), block(2))  # a retried step's export of a block it already overwrote
    assert np.array_equal(store.get(key(1)), block(1))


@contextlib.contextmanager
def umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_folders_are_created_0700_and_files_0600_whatever_the_umask(tmp_path):
    folder = tmp_path / "kv_tiers" / "arithmetic" / "model"
    with umask(0o022):  # the usual one: 0755 folders and 0644 files unless the store says otherwise
        store = disk_store(folder)
        store.put(key(1), block(1))
        store.flush()
    assert [mode(p) for p in (tmp_path / "kv_tiers", folder.parent, folder)] == [0o700] * 3
    files = list(folder.iterdir())
    assert [f.name for f in files] == [f"{key(1)}{SUFFIX}"] and mode(files[0]) == 0o600


def test_a_folder_an_earlier_version_left_open_to_others_is_closed(tmp_path):
    folder = tmp_path / "tiers"
    with umask(0o022):
        folder.mkdir()
    assert mode(folder) == 0o755
    disk_store(folder)
    assert mode(folder) == 0o700


def test_a_folder_that_is_a_symbolic_link_is_refused(tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    (tmp_path / "tiers").symlink_to(real)
    with pytest.raises(RuntimeError, match=r"tiers is a symbolic link.*runtime\.kv_tiers\.disk_dir"):
        disk_store(tmp_path / "tiers")
    assert list(real.iterdir()) == []


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "tiers"
    folder.mkdir(mode=0o700)
    other = os.geteuid() + 1
    if os.geteuid() == 0:
        os.chown(folder, other, -1)  # a real folder of another user
    else:  # only root can give a folder away: this process plays the other user instead
        monkeypatch.setattr(os, "geteuid", lambda: other)
    with pytest.raises(RuntimeError, match=r"tiers belongs to user id \d+.*runtime\.kv_tiers\.disk_dir"):
        disk_store(folder)


def test_a_block_file_that_is_a_symbolic_link_is_not_followed(tmp_path):
    folder, outside = tmp_path / "tiers", tmp_path / "outside"
    store = disk_store(folder)
    store.put(key(1), block(1))
    store.flush()
    store.close()
    # a valid block file of key 2, outside the folder, and a link to it in the folder
    outside.mkdir()
    store = disk_store(outside)
    store.put(key(2), block(2))
    store.flush()
    store.close()
    (folder / f"{key(2)}{SUFFIX}").symlink_to(outside / f"{key(2)}{SUFFIX}")
    again = disk_store(folder)
    assert again.keys() == {key(1)} and again.counts["ignored_files"] == 1
    assert again.get(key(2)) is None

    # links planted where the store writes (its file and its temporary files) are replaced,
    # never written through
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    for name in (f"{key(3)}{SUFFIX}", f"{key(3)}.tmp", f"{key(3)}.{os.getpid()}.tmp"):
        (folder / name).symlink_to(victim)
    again.put(key(3), block(3))
    again.flush()
    assert victim.read_bytes() == b"untouched"
    assert not (folder / f"{key(3)}{SUFFIX}").is_symlink()
    assert np.array_equal(disk_store(folder).get(key(3)), block(3))


def planted(header: bytes) -> bytes:
    return MAGIC + struct.pack("<I", len(header)) + header


def test_a_deeply_nested_header_and_other_garbage_are_ignored_counted_and_the_store_opens(tmp_path, caplog):
    folder = tmp_path / "tiers"
    store = disk_store(folder)
    store.put(key(1), block(1))
    store.flush()
    store.close()
    data = (folder / f"{key(1)}{SUFFIX}").read_bytes()
    (length,) = struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])
    good = json.loads(data[len(MAGIC) + 4 : len(MAGIC) + 4 + length])
    files = {
        key(2): planted(b"[" * 60000),  # RecursionError in json's parser (a header may be 64 KiB)
        key(3): planted(b"{" * 30000),
        key(4): planted(b"\xff\xfe not UTF-8"),
        key(5): planted(b"[1, 2]"),
        key(6): planted(json.dumps({**good, "key": key(6), "nbytes": "many"}).encode()),
        key(7): MAGIC + b"\xff\xff",
        key(8): b"",
    }
    for name, data in files.items():
        (folder / f"{name}{SUFFIX}").write_bytes(data)
    (folder / f"{key(9)}{SUFFIX}").mkdir()  # not a file at all
    os.mkfifo(folder / f"{key(10)}{SUFFIX}")  # opening it to read would wait for a writer
    with caplog.at_level(logging.WARNING, logger="agent.kv_tiers"), deadline(30):
        again = disk_store(folder)
    assert again.keys() == {key(1)}
    assert again.counts["ignored_files"] == len(files) + 2
    assert again.report(0.0).counts["ignored_files"] == len(files) + 2  # in /metrics
    assert f"{len(files) + 2} files in {folder} ignored" in caplog.text
    # a file the scan loaded, replaced afterwards by one the parser cannot take: a miss, not a crash
    (folder / f"{key(1)}{SUFFIX}").write_bytes(planted(b"[" * 60000))
    assert again.get(key(1)) is None and again.counts["ignored_files"] == len(files) + 3


def test_a_report_names_the_keys_the_host_tier_let_go_once():
    store = KVTierStore(LAYOUT, MODEL, host_bytes=3 * BLOCK)
    for i in range(5):
        store.put(key(i), block(i))
    assert store.report(0.0).evicted_keys == (key(0), key(1))
    assert store.report(0.0).evicted_keys == ()  # reported already
    store.put(key(5), block(5))  # 2 goes
    store.put(key(2), block(2))  # and comes back (3 goes): held, so never reported as let go
    assert store.report(0.0).evicted_keys == (key(3),)


def test_a_report_names_only_keys_neither_tier_holds(tmp_path, monkeypatch):
    store = disk_store(tmp_path, host_blocks=1, disk_blocks=2)
    for i in range(4):
        store.put(key(i), block(i))
        store.flush()  # written one by one: the disk keeps the two most recent
    assert store.keys() == {key(2), key(3)}
    # 0 and 1 left host memory when they were still on disk: reported once the disk let them go
    assert set(store.report(0.0).evicted_keys) == {key(0), key(1)}

    full = disk_store(tmp_path / "full", queue_blocks=1)
    disk_free, write = threading.Event(), full._write
    # a slow disk (the one fault stood in for): the queue stays full, the next write is dropped
    monkeypatch.setattr(full, "_write", lambda *item: (disk_free.wait(10), write(*item)))
    for i in range(3):
        full.put(key(i), block(i))
    disk_free.set()
    full.flush()
    assert full.counts["dropped_writes"] >= 1
    assert set(full.report(0.0).evicted_keys) == {key(i) for i in range(3)} - full.keys()


def test_a_report_names_at_most_its_bound_the_most_recent_kept():
    store = KVTierStore(LAYOUT, MODEL, host_bytes=BLOCK)
    for i in range(MAX_REPORTED_EVICTIONS + 100):
        store.put(key(i), block(0))
    first = store.report(0.0).evicted_keys
    # the store keeps no more than the bound either: the oldest went, unreported (the scheduler's
    # index forgets them by its own capacity)
    assert len(first) == MAX_REPORTED_EVICTIONS and first[-1] == key(MAX_REPORTED_EVICTIONS + 98)
    assert store.report(0.0).evicted_keys == ()
