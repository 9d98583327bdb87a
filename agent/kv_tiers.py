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
and counted, never loaded: wrong KV would silently change answers.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import struct
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from agent.contract.step_reply import TIER_COUNTS, TierReport

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
        self._queue: queue.Queue[tuple[str, np.ndarray] | None] = queue.Queue(
            queue_blocks or max(WRITE_QUEUE_BLOCKS, WRITE_QUEUE_BYTES // layout.nbytes)
        )
        self._writer: threading.Thread | None = None
        self._readers: ThreadPoolExecutor | None = None  # get_many's, started on first use
        if self.disk_bytes:
            assert disk_dir is not None
            disk_dir.mkdir(parents=True, exist_ok=True)
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

    def report(self, restore_s: float) -> TierReport:
        """What it counted since the previous report, the bytes each tier holds now."""
        with self._lock:
            counts = {name: n - self._reported[name] for name, n in self.counts.items()}
            self._reported = dict(self.counts)
            return TierReport(counts, self._host_used, sum(self._disk.values()), restore_s)

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
            # a digest names its content: the copy held is as good (a retried step's may not be)
            if key in self._host:
                self._host.move_to_end(key)
            else:
                self._keep_in_host(key, kv)
            if not self.disk_bytes or key in self._disk or key in self._pending:
                return
            try:
                self._queue.put_nowait((key, kv))
            except queue.Full:
                self.counts["dropped_writes"] += 1
                return
            self._pending[key] = kv

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
                    _remove(self._path(key))
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
                _remove(self._path(key))
            self._disk.clear()
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
            _, old = self._host.popitem(last=False)
            self._host_used -= old.nbytes

    def _path(self, key: str) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / f"{key}{SUFFIX}"

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

    def _read_header(self, path: Path, key: str) -> tuple[dict, int] | None:
        """(header, the payload's offset) when the file is one of ours for `key` and long enough."""
        try:
            with path.open("rb") as f:
                opened = _header_of(f)
                if opened is None:
                    return None
                header, offset = opened
                if (
                    not self._matches(header, key)
                    or os.fstat(f.fileno()).st_size != offset + header["nbytes"]
                ):
                    return None
                return header, offset
        except (OSError, ValueError):  # json's errors are ValueErrors, a bad UTF-8 header too
            return None

    def _read(self, key: str) -> np.ndarray | None:
        path = self._path(key)
        found = self._read_header(path, key)
        if found is None:
            return None
        header, offset = found
        payload = bytearray(header["nbytes"])  # read into: the array owns it, writable, no copy
        try:
            with path.open("rb") as f:
                f.seek(offset)
                if f.readinto(payload) != len(payload):
                    return None
            _touch(path)
        except OSError:
            return None
        if zlib.crc32(payload) != header["checksum"]:  # corruption, not an adversary: see the module
            return None
        return np.frombuffer(payload, self.layout.dtype).reshape(self.layout.shape)

    def _scan(self) -> None:
        """Index the files a previous run left, least recently used first; count what is not ours."""
        assert self.disk_dir is not None
        found = []
        for path in self.disk_dir.iterdir():
            if path.suffix != SUFFIX:
                continue  # a write that a crash interrupted (.tmp), or not ours at all
            key = path.stem
            if not _KEY.fullmatch(key) or self._read_header(path, key) is None:
                self.counts["ignored_files"] += 1
                if _older_format(path):  # this folder's, written before a format change: never read again
                    _remove(path)
                continue
            stat = path.stat()
            found.append((stat.st_mtime_ns, key, stat.st_size))
        for _, key, size in sorted(found):
            self._disk[key] = size
        self._evict_disk()
        if found or self.counts["ignored_files"]:
            log.info(
                "KV tier: %d blocks on disk in %s, %d files ignored",
                len(self._disk),
                self.disk_dir,
                self.counts["ignored_files"],
            )

    def _evict_disk(self) -> None:
        """Under the lock: the least recently used files go while over the bound."""
        used = sum(self._disk.values())
        while used > self.disk_bytes and self._disk:
            key, size = self._disk.popitem(last=False)
            _remove(self._path(key))
            used -= size
            self.counts["evicted"] += 1

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
            finally:
                self._queue.task_done()

    def _write(self, key: str, kv: np.ndarray) -> None:
        payload = kv.tobytes()
        header = json.dumps(self._header(key, payload)).encode()
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:  # written whole, then renamed: a reader never sees half a file
            f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
        os.replace(tmp, path)
        _touch(path)
        with self._lock:
            self._pending.pop(key, None)
            self._disk[key] = path.stat().st_size
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


def _older_format(path: Path) -> bool:
    """A file of this store's own format, of an earlier version."""
    try:
        with path.open("rb") as f:
            opened = _header_of(f)
        version = opened[0].get("version") if opened else None
    except (OSError, ValueError):
        return False
    return type(version) is int and 0 < version < FORMAT_VERSION


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"a KV tier key is 8..128 lowercase hex digits, not {key!r:.40}")


def _touch(path: Path) -> None:
    """Recency survives a restart: the scan orders files by mtime. Set from the fine clock (the
    file system's own stamps may tick only every few ms, tying blocks used one after another)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
