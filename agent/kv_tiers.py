"""KVTierStore: the second tier of the prefix cache, cached blocks' K/V kept after the KV pool lets
them go, in host memory and then in files that survive a restart.

    store = KVTierStore(layout, model_identity, host_bytes, disk_bytes, disk_dir)
    store.put(key, kv)        # one block's K/V [2 * layers, KV heads, block_size, row width]
    kv = store.get(key)       # None: not held, or its file was truncated, corrupt or foreign
    store.keys()              # what it holds (at start: the files a previous run left, validated)

A block is named by `key`, the hex hash of its prefix chain (the scheduler's: it includes the cache
salt, so a salted block is only found under its salt's chain). Both tiers are bounded in bytes and
evict least recently used first. A put is written through to disk by a background thread with a
bounded queue (a full queue drops the write and counts it: the step never waits on a disk), so
blocks still in host memory survive a restart too.

Each file is MAGIC, a header length, a JSON header, then the payload. The header names the format
version, the model (`model_identity`: whatever the caller derives from the model's files, e.g. the
weights fingerprint of agent/compile_cache.py), the KV layout and the payload's checksum (CRC-32:
it catches a damaged or half-written file; whoever may write the folder may write any KV, so it is
the operator's, as the model file is). A file
that does not match all of them (another model, another layout, truncated, corrupt) is ignored
and counted, never loaded: wrong KV would silently change answers; whatever a malformed file raises
while it is read (a header nested too deep for the JSON parser included) counts the same.

The files hold what the prompts were (layer 0's K rows depend only on the token and its position,
and the weights are public), so they are this user's alone: folders are created 0700 and files 0600
(so from the start, never loosened), and every file is opened through a descriptor of the store's
folder, never through a symbolic link (O_NOFOLLOW); a folder that is a link or another user's is
refused at start. `report()` also names the keys the store let go since the previous report (out of
both tiers: least recently used, a write the full queue dropped, a corrupt file), so whoever
indexes its blocks (the scheduler) forgets them too.
"""

from __future__ import annotations

import io
import json
import logging
import os
import queue
import re
import stat
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from agent.contract.step_reply import MAX_REPORTED_EVICTIONS, TIER_COUNTS, TierReport

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 2: CRC-32 checksums (BLAKE2b's took half a restore's time); 3: rows of a q8_0 cache
READ_THREADS = 4  # files read and checked at once by get_many (file reads and CRC-32 release the GIL)
MAGIC = b"MSLLMKV\n"
SUFFIX = ".kv"
LARGEST_HEADER = 1 << 16  # a header longer than this is no header of ours
# writes waiting for the disk, at least this many blocks or bytes; more are dropped (and counted): a
# step of a long prompt saves (write-through) a block per block_size positions it computes
WRITE_QUEUE_BLOCKS = 64
WRITE_QUEUE_BYTES = 256 << 20
_KEY = re.compile(r"[0-9a-f]{8,128}")  # a key is a file name: hex only, no path can hide in it
FOLDER_MODE = 0o700  # the files hold what the prompts were: this user's alone
FILE_MODE = 0o600
# a block file opened to read: never through a link, never waiting on a planted FIFO (refused after fstat)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# a block file written: a new file of this user's (O_EXCL: nothing planted under its name is reused)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class KVLayout:
    """What one block's K/V is: its shape and element type, and the kernels' cache layout (a block
    written with one layout means something else read with another)."""

    layers: int
    kv_heads: int
    head_dim: int
    row_width: int  # a cache row's elements: head_dim, or a q8_0 row's bytes (agent/graphs/cache_format.py)
    block_size: int
    dtype: str  # numpy's name, e.g. "float16"
    kernel_layout: str  # e.g. "paged" or "contiguous"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2 * self.layers, self.kv_heads, self.block_size, self.row_width)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


class KVTierStore:
    def __init__(
        self,
        layout: KVLayout,
        model_identity: str,
        host_bytes: int,
        disk_bytes: int = 0,
        disk_dir: Path | None = None,
        queue_blocks: int | None = None,
    ):
        if host_bytes < 0 or disk_bytes < 0:
            raise ValueError(f"tier bounds are bytes >= 0, got {host_bytes} and {disk_bytes}")
        if disk_bytes and disk_dir is None:
            raise ValueError("a disk tier needs its folder")
        self.layout = layout
        self.model_identity = model_identity
        self.host_bytes = host_bytes
        self.disk_bytes = disk_bytes if disk_dir is not None else 0
        self.disk_dir = disk_dir
        self.counts = dict.fromkeys(TIER_COUNTS, 0)  # cumulative
        self._reported = dict(self.counts)  # as of the last report()
        self._lock = threading.Lock()
        self._host: OrderedDict[str, np.ndarray] = OrderedDict()  # LRU: first = least recently used
        self._host_used = 0  # bytes in _host
        self._disk: OrderedDict[str, int] = OrderedDict()  # key -> its file's bytes, LRU likewise
        self._pending: dict[str, np.ndarray] = {}  # queued for the disk, not yet written
        # keys let go (in neither tier nor queued) since the last report, oldest first; bounded: the
        # scheduler's index is bounded by capacity_blocks too, whatever is not reported
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._queue: queue.Queue[tuple[str, np.ndarray] | None] = queue.Queue(
            queue_blocks or max(WRITE_QUEUE_BLOCKS, WRITE_QUEUE_BYTES // layout.nbytes)
        )
        self._writer: threading.Thread | None = None
        self._readers: ThreadPoolExecutor | None = None  # get_many's, started on first use
        self._folder = -1  # the disk tier's folder, opened: every file is reached through it
        if self.disk_bytes:
            assert disk_dir is not None
            self._folder = _open_folder(disk_dir)
            weakref.finalize(self, os.close, self._folder)
            self._scan()
            self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
            self._writer.start()

    # --- gauges ---

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_bytes)

    @property
    def host_used(self) -> int:
        with self._lock:
            return self._host_used

    @property
    def disk_used(self) -> int:
        with self._lock:
            return sum(self._disk.values())

    @property
    def capacity_blocks(self) -> int:
        """The most blocks both tiers hold at once (a file is a little larger than its block)."""
        return (self.host_bytes + self.disk_bytes) // self.layout.nbytes

    def report(self, restore_s: float) -> TierReport:
        """What it counted since the previous report, the bytes each tier holds now, and the keys it
        let go since then (at most MAX_REPORTED_EVICTIONS: the rest go with the next report)."""
        with self._lock:
            counts = {name: n - self._reported[name] for name, n in self.counts.items()}
            self._reported = dict(self.counts)
            evicted: list[str] = []
            while self._evicted and len(evicted) < MAX_REPORTED_EVICTIONS:
                evicted.append(self._evicted.popitem(last=False)[0])
            return TierReport(counts, self._host_used, sum(self._disk.values()), restore_s, tuple(evicted))

    def keys(self) -> set[str]:
        with self._lock:
            return set(self._host) | set(self._disk) | set(self._pending)

    def recent_keys(self, limit: int) -> list[str]:
        """At most `limit` keys, the most recently used first (host memory's, then the disk's)."""
        with self._lock:
            keys = dict.fromkeys([*reversed(self._host), *self._pending, *reversed(self._disk)])
        return list(keys)[:limit]

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._host or key in self._disk or key in self._pending

    # --- changes ---

    def put(self, key: str, kv: np.ndarray) -> None:
        """Keep a block's K/V under `key` (a copy: the caller's array may be a reused buffer)."""
        _check_key(key)
        if kv.shape != self.layout.shape or kv.dtype != np.dtype(self.layout.dtype):
            want = f"{self.layout.dtype}{list(self.layout.shape)}"
            raise ValueError(f"a block's K/V is {want}, not {kv.dtype}{list(kv.shape)}")
        kv = np.array(kv, copy=True, order="C")
        with self._lock:
            self._evicted.pop(key, None)  # held again: never reported as let go
            # a digest names its content: the copy held is as good (a retried step's may not be)
            if key in self._host:
                self._host.move_to_end(key)
            else:
                self._keep_in_host(key, kv)
            if self.disk_bytes and key not in self._disk and key not in self._pending:
                try:
                    self._queue.put_nowait((key, kv))
                    self._pending[key] = kv
                except queue.Full:
                    self.counts["dropped_writes"] += 1
            self._note_if_evicted(key)  # no room in host memory and no disk: never held

    def get(self, key: str) -> np.ndarray | None:
        """The block's K/V, from host memory, else from its file (validated, then kept in host memory
        too); None when neither holds it or its file is not valid (then counted and forgotten)."""
        _check_key(key)
        with self._lock:
            kv = self._host.get(key)
            if kv is not None:
                self._host.move_to_end(key)
                self.counts["host_hits"] += 1
                return kv
            kv = self._pending.get(key)
            if kv is not None:
                self.counts["host_hits"] += 1
                return kv
            on_disk = key in self._disk
        kv = self._read(key) if on_disk else None
        with self._lock:
            if kv is None:
                self.counts["misses"] += 1
                if on_disk and self._disk.pop(key, None) is not None:
                    self.counts["ignored_files"] += 1
                    self._remove(key)
                    self._note_if_evicted(key)
                return None
            self.counts["disk_hits"] += 1
            if key in self._disk:
                self._disk.move_to_end(key)
            self._keep_in_host(key, kv)
            return kv

    def get_many(self, keys: list[str]) -> list[np.ndarray | None]:
        """get() of each key, in order; files read and checked side by side."""
        if len(keys) < 2 or not self.disk_bytes:
            return [self.get(key) for key in keys]
        if self._readers is None:
            self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-tier-reader")
        return list(self._readers.map(self.get, keys))

    def drop(self) -> int:
        """Forget every block, both tiers (an operator's reset); returns how many were held."""
        self.flush()
        with self._lock:
            keys = set(self._host) | set(self._disk)
            self._host.clear()
            self._host_used = 0
            self._pending.clear()
            for key in self._disk:
                self._remove(key)
            self._disk.clear()
            self._evicted.clear()  # the scheduler empties its index itself (an operator's reset)
            return len(keys)

    def flush(self) -> None:
        """Wait for the queued writes (tests, drop)."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown()
            self._readers = None
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=30)
            self._writer = None

    # --- internals ---

    def _keep_in_host(self, key: str, kv: np.ndarray) -> None:
        """Under the lock: kv becomes the most recently used; the least recently used go over the bound."""
        if not self.host_bytes or kv.nbytes > self.host_bytes:
            return
        old = self._host.pop(key, None)
        self._host[key] = kv
        self._host_used += kv.nbytes - (0 if old is None else old.nbytes)
        while self._host_used > self.host_bytes:
            gone, old = self._host.popitem(last=False)
            self._host_used -= old.nbytes
            self._note_if_evicted(gone)

    def _note_if_evicted(self, key: str) -> None:
        """Under the lock: `key` is reported as let go when neither tier holds it nor will."""
        if key in self._host or key in self._disk or key in self._pending:
            return
        self._evicted[key] = None
        if len(self._evicted) > max(self.capacity_blocks, MAX_REPORTED_EVICTIONS):
            self._evicted.popitem(last=False)

    def _open_file(self, key: str) -> io.BufferedReader:
        """`key`'s file in the store's folder, to read: OSError where it is a link or not a plain
        file of this user (a FIFO, a folder, another user's file planted in an older folder)."""
        f = os.fdopen(os.open(f"{key}{SUFFIX}", _READ_FLAGS, dir_fd=self._folder), "rb")
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            f.close()
            raise OSError(f"{key}{SUFFIX} is not a plain file of this user")
        return f

    def _remove(self, key: str, suffix: str = SUFFIX) -> None:
        try:
            os.unlink(f"{key}{suffix}", dir_fd=self._folder)  # a link itself goes, never its target
        except FileNotFoundError:
            pass

    def _header(self, key: str, payload: bytes) -> dict:
        return {
            "version": FORMAT_VERSION,
            "model": self.model_identity,
            "layout": asdict(self.layout),
            "key": key,
            "nbytes": len(payload),
            "checksum": zlib.crc32(payload),
        }

    def _matches(self, header: object, key: str) -> bool:
        """The header is of this format, model, layout and key (the checksum is checked on load)."""
        return (
            isinstance(header, dict)
            and header.get("version") == FORMAT_VERSION
            and header.get("model") == self.model_identity
            and header.get("layout") == asdict(self.layout)
            and header.get("key") == key
            and header.get("nbytes") == self.layout.nbytes
            and type(header.get("checksum")) is int
        )

    def _valid_header(self, f: io.BufferedReader, key: str) -> tuple[dict, int] | None:
        """(header, the payload's offset) when the open file is one of ours for `key` and of its
        whole length; the file is then positioned at the payload. Raises what a malformed file
        makes the parser raise."""
        opened = _header_of(f)
        if opened is None:
            return None
        header, offset = opened
        if not self._matches(header, key) or os.fstat(f.fileno()).st_size != offset + header["nbytes"]:
            return None
        return header, offset

    def _read(self, key: str) -> np.ndarray | None:
        try:
            with self._open_file(key) as f:
                found = self._valid_header(f, key)
                if found is None:
                    return None
                header, _ = found
                payload = bytearray(header["nbytes"])  # read into: the array owns it, writable, no copy
                if f.readinto(payload) != len(payload):
                    return None
                _touch(f.fileno())
        except Exception:  # whatever a malformed file raises (a RecursionError too): not loaded
            return None
        if zlib.crc32(payload) != header["checksum"]:  # corruption, not an adversary: see the module
            return None
        return np.frombuffer(payload, self.layout.dtype).reshape(self.layout.shape)

    def _scan(self) -> None:
        """Index the files a previous run left, least recently used first; count what is not ours.
        Nothing a file holds stops the start: each is loaded, or ignored and counted."""
        found = []
        for name in os.listdir(self._folder):
            if not name.endswith(SUFFIX):
                continue  # a write that a crash interrupted (.tmp), or not ours at all
            key = name[: -len(SUFFIX)]
            try:
                seen = self._scan_file(key) if _KEY.fullmatch(key) else None
            except Exception:  # a header nested past the parser's depth (RecursionError), a link...
                seen = None
            if seen is None:
                self.counts["ignored_files"] += 1
                continue
            found.append((*seen, key))
        for _, size, key in sorted(found):
            self._disk[key] = size
        self._evict_disk()
        self._evicted.clear()  # never indexed by anyone: nothing to report
        if found:
            log.info("KV tier: %d blocks on disk in %s", len(self._disk), self.disk_dir)
        if self.counts["ignored_files"]:
            log.warning(
                "KV tier: %d files in %s ignored (another model's or layout's, an earlier format, "
                "truncated, corrupt, or not a plain file of this user)",
                self.counts["ignored_files"],
                self.disk_dir,
            )

    def _scan_file(self, key: str) -> tuple[int, int] | None:
        """(mtime, size) of `key`'s file when it is a valid block; None when not (one of an earlier
        format of this store is removed: never read again)."""
        with self._open_file(key) as f:
            if self._valid_header(f, key) is not None:
                info = os.fstat(f.fileno())
                return info.st_mtime_ns, info.st_size
            f.seek(0)
            opened = _header_of(f)
        version = opened[0].get("version") if opened else None
        if type(version) is int and 0 < version < FORMAT_VERSION:
            self._remove(key)
        return None

    def _evict_disk(self) -> None:
        """Under the lock: the least recently used files go while over the bound."""
        used = sum(self._disk.values())
        while used > self.disk_bytes and self._disk:
            key, size = self._disk.popitem(last=False)
            self._remove(key)
            used -= size
            self.counts["evicted"] += 1
            self._note_if_evicted(key)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # a full or failing disk loses the block, never the agent
                log.exception("KV tier: writing a block failed")
                assert item is not None
                with self._lock:
                    self._pending.pop(item[0], None)
                    self._note_if_evicted(item[0])
            finally:
                self._queue.task_done()

    def _write(self, key: str, kv: np.ndarray) -> None:
        payload = kv.tobytes()
        header = json.dumps(self._header(key, payload)).encode()
        # written whole, then renamed: a reader never sees half a file. Per process: agents of one
        # model share the folder
        tmp = f"{key}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, _WRITE_FLAGS, FILE_MODE, dir_fd=self._folder)
        except FileExistsError:  # a crashed run's (or something planted): unlinked, never followed
            self._remove(key, f".{os.getpid()}.tmp")
            fd = os.open(tmp, _WRITE_FLAGS, FILE_MODE, dir_fd=self._folder)
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
            f.flush()
            _touch(f.fileno())
            size = os.fstat(f.fileno()).st_size
        os.replace(tmp, f"{key}{SUFFIX}", src_dir_fd=self._folder, dst_dir_fd=self._folder)
        with self._lock:
            self._pending.pop(key, None)
            self._disk[key] = size
            self._disk.move_to_end(key)
            self.counts["written"] += 1
            self._evict_disk()


def _header_of(f) -> tuple[dict, int] | None:
    """An open file's header and its payload's offset, when it starts as this store's files do."""
    start = f.read(len(MAGIC) + 4)
    if len(start) != len(MAGIC) + 4 or start[: len(MAGIC)] != MAGIC:
        return None
    (length,) = struct.unpack("<I", start[len(MAGIC) :])
    if length > LARGEST_HEADER:
        return None
    header = json.loads(f.read(length))
    return (header, len(MAGIC) + 4 + length) if isinstance(header, dict) else None


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"a KV tier key is 8..128 lowercase hex digits, not {key!r:.40}")


def _touch(fd: int) -> None:
    """Recency survives a restart: the scan orders files by mtime. Set from the fine clock (the
    file system's own stamps may tick only every few ms, tying blocks used one after another)."""
    now = time.time_ns()
    os.utime(fd, ns=(now, now))


def _open_folder(folder: Path) -> int:
    """The disk tier's folder, opened (every file is then reached through this descriptor: a
    folder renamed or swapped for a link later changes nothing), the missing ones of it and its
    parents created 0700 first. Refused where it is a link or another user's; one of this user's
    that others may read (an earlier version's, created 0755) is closed to them."""
    missing = []
    at = folder
    while not os.path.lexists(at) and at != at.parent:
        missing.append(at)
        at = at.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, FOLDER_MODE)
        except FileExistsError:  # another agent of the model made it meanwhile
            pass
    if os.path.islink(folder):
        raise RuntimeError(
            f"the KV tier's folder {folder} is a symbolic link, which the disk tier never follows "
            "(whoever can change the link would read or plant blocks): set runtime.kv_tiers.disk_dir "
            "to the real folder, or replace the link by the folder itself"
        )
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        os.close(fd)
        raise RuntimeError(
            f"the KV tier's folder {folder} belongs to user id {info.st_uid}, not to this process's "
            f"({os.geteuid()}): that user could read the prompts' blocks or plant others; remove "
            "it, or set runtime.kv_tiers.disk_dir to a folder of this user's"
        )
    if info.st_mode & 0o077:
        log.warning("KV tier: %s was open to other users: now %o (this user's alone)", folder, FOLDER_MODE)
        os.fchmod(fd, FOLDER_MODE)
    return fd
