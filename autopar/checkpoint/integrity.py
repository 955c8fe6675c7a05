"""Checksums of every file of a checkpoint step, written before the step is committed and checked
before it is read.

orbax writes arrays as zarr chunks in an OCDBT database. The database's index (manifest and
b-tree nodes, which also hold chunks under 1 KiB inline) carries checksums, but larger chunks are
written to data files without one, and zarr2 with zstd decodes a flipped byte into wrong numbers
without an error. orbax offers no option to add zarr3's ``crc32c`` chunk codec, so autopar keeps
its own record: the size of every file of the step and a 64-bit checksum of each 32 MiB block of
it (``RECORD``, ``_sum64``), computed by the primary process after every process has written its
files and orbax has merged the index, and before orbax renames the temporary directory into
place (``AsyncOptions.post_finalization_callback``). A step directory that exists therefore
always carries its record, and a step killed before its rename is not a step at all.

Restoring reads the record and checks the index and metadata files before orbax reads any
array, and the array chunks while orbax reads them (the state is returned only if they match).
The files are shared out over the processes of a job and the damaged ones gathered, so each host
reads about its share once more. Blocks are hashed in a few threads at memory speed (numpy,
GIL released): CRC-32 (``zlib``) ran at a third of the speed and cost GPT-59M's restore 20% on
two cores. What a damaged file holds is found from the OCDBT index (``arrays_in``), so an error
names the arrays as well as the file.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import threading
import zlib
from collections.abc import Iterable

import jax
import numpy as np
from etils import epath

RECORD = "autopar_integrity.json"
RECORD_VERSION = 1      # blocks of BLOCK_BYTES, each with a _sum64 checksum
# Top-level files orbax rewrites when it commits the step, after the record is taken: its step
# metadata (timestamps) and, on storage without atomic renames, the commit marker.
_UNRECORDED = (RECORD, "_CHECKPOINT_METADATA", "commit_success.txt")
# Files are hashed in blocks of this many bytes, all blocks in parallel: a checkpoint's data is
# mostly in one or two large files.
BLOCK_BYTES = 32 << 20
_THREADS = max(2, min(8, os.cpu_count() or 2))


# ---- writing -------------------------------------------------------------------------------------
def write_record(step_dir: epath.Path) -> dict:
    """Checksum every file under ``step_dir`` and write ``RECORD`` there; returns the record."""
    record = record_of(step_dir)
    (step_dir / RECORD).write_text(json.dumps(record))
    return record


def record_of(step_dir: epath.Path) -> dict:
    """The record of the files under ``step_dir`` as they are now (reads every file): per file
    its size and the checksum (``_sum64``) of each ``BLOCK_BYTES`` block."""
    files = sorted(_files(step_dir))
    sizes = {f: (step_dir / f).stat().length for f in files}
    sums = _checksums(step_dir, sizes)
    record = {"version": RECORD_VERSION, "block_bytes": BLOCK_BYTES,
              "files": {f: [sizes[f], sums[f]] for f in files}}
    record["crc32"] = _self_crc(record)
    return record


def _files(root: epath.Path, prefix: str = "") -> Iterable[str]:
    """Files under ``root``, relative to it (a walk: epath has no recursive glob on GCS)."""
    for path in root.iterdir():
        name = prefix + path.name
        if path.is_dir():
            yield from _files(path, name + "/")
        elif name not in _UNRECORDED:
            yield name


def _self_crc(record: dict) -> int:
    body = {k: v for k, v in record.items() if k != "crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def _checksums(root: epath.Path, sizes: dict[str, int]) -> dict[str, list[int]]:
    """File -> the checksum (``_sum64``) of each of its blocks, the blocks of all files hashed
    in parallel (one large file would otherwise keep a single core busy), each thread reading
    into one buffer of its own (a fresh 32 MiB object per block costs more than the hash)."""
    blocks = [(f, at) for f, n in sizes.items() for at in range(0, max(n, 1), BLOCK_BYTES)]
    local = threading.local()
    size = min(BLOCK_BYTES, max(sizes.values(), default=1))
    weights = _weights(size)

    def checksum(block) -> int:
        f, at = block
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(size)
        with (root / f).open("rb") as h:
            h.seek(at)
            if hasattr(h, "readinto"):
                return _sum64(memoryview(buf)[:h.readinto(buf)], weights)
            return _sum64(memoryview(h.read(size)), weights)

    with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
        sums = list(pool.map(checksum, blocks))
    out: dict[str, list[int]] = {f: [] for f in sizes}
    for (f, _), c in zip(blocks, sums):
        out[f].append(c)
    return out


def _weights(nbytes: int) -> np.ndarray:
    """One odd 64-bit weight per 8-byte word of a block (Fibonacci hashing of the position)."""
    i = np.arange(nbytes // 8 + 1, dtype=np.uint64)
    return (i * np.uint64(0x9E3779B97F4A7C15)) ^ (i >> np.uint64(29)) | np.uint64(1)


def _sum64(data: memoryview, weights: np.ndarray) -> int:
    """The block's 64-bit little-endian words times their weights, summed modulo 2**64 (a
    partial last word zero-padded). Every weight is odd, so any change to one word changes the
    sum; a change spread over several words goes unnoticed with a chance of about 2**-64. It
    runs at memory speed (numpy's einsum, GIL released), some 3x CRC-32's."""
    whole = len(data) // 8
    total = int(np.einsum("i,i->", np.frombuffer(data[:whole * 8], np.uint64),
                          weights[:whole])) if whole else 0
    tail = bytes(data[whole * 8:])
    if tail:
        total += int.from_bytes(tail.ljust(8, b"\0"), "little") * int(weights[whole])
    return total % 2**64


# ---- reading -------------------------------------------------------------------------------------
class RecordProblem(Exception):
    """The record itself is missing or unreadable (``str`` says how)."""


def read_record(step_dir: epath.Path) -> dict:
    path = step_dir / RECORD
    if not path.exists():
        raise RecordProblem(f"it has no integrity record ({RECORD})")
    try:
        record = json.loads(path.read_text())
        files = record["files"]
        ok = (isinstance(files, dict) and record.get("crc32") == _self_crc(record)
              and record.get("block_bytes") == BLOCK_BYTES
              and all(isinstance(v, list) and len(v) == 2 and isinstance(v[1], list)
                      for v in files.values()))
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as e:
        raise RecordProblem(f"its integrity record {RECORD} is unreadable ({e})") from None
    if not ok:
        raise RecordProblem(f"its integrity record {RECORD} is damaged (its own CRC-32 differs)")
    return record


def bulk(file: str) -> bool:
    """A file of array chunks (most of a step's bytes), as opposed to index and metadata."""
    return re.match(r"state/ocdbt\.process_\d+/d/", file) is not None


def share(files, part: tuple[int, int]) -> list[str]:
    """This process's share ``part`` = (index, count) of ``files``: every ``count``-th of them
    in sorted order, from ``index``."""
    return sorted(files)[part[0]::part[1]]


def damaged_files(step_dir: epath.Path, record: dict, files=None) -> dict[str, str]:
    """Recorded file -> what is wrong with it, over ``files`` (default every recorded file)."""
    files = sorted(record["files"]) if files is None else list(files)
    present = [f for f in files if (step_dir / f).is_file()]
    bad = {f: "is missing" for f in files if f not in present}
    sizes = {f: (step_dir / f).stat().length for f in present}
    for f in present:
        want = record["files"][f][0]
        if sizes[f] != want:
            bad[f] = f"has {sizes[f]} bytes where {want} were written (truncated or extended)"
    sums = _checksums(step_dir, {f: sizes[f] for f in present if f not in bad})
    for f, got in sums.items():
        if got != record["files"][f][1]:
            bad[f] = "holds other bytes than were written (its checksum differs from the record)"
    return bad


# ---- what a file holds -------------------------------------------------------------------------
def arrays_in(state_dir: epath.Path, files: Iterable[str]) -> dict[str, set[str]] | None:
    """For files of a ``state`` item (paths relative to it), the names of the arrays (orbax's
    dotted names) with chunks in them, read from the OCDBT index; a file of the index itself
    maps to ``{"*"}`` (every array), a file no entry of the merged index reads to an empty set
    (a process's own index of what it wrote). None when the index cannot be read."""
    import tensorstore as ts

    wanted = set(files)
    out: dict[str, set[str]] = {f: set() for f in wanted}
    for f in wanted:
        if f == "manifest.ocdbt" or f.endswith("/manifest.ocdbt"):
            out[f].add("*")
    try:
        base = ts.KvStore.open(_kvstore_url(state_dir)).result()
        top = ts.ocdbt.dump(base).result()
        roots = [v["root"]["location"] for v in top.get("versions", [])[-1:]
                 if v.get("root", {}).get("location")]
        for loc in roots:
            _walk(ts, base, loc, out)
    except Exception:  # noqa: BLE001 - a damaged index: the caller says so
        return None
    return out


def _kvstore_url(path: epath.Path) -> str:
    text = str(path)
    return (text if "://" in text else "file://" + text).rstrip("/") + "/"


def _file_of(location: str) -> str | None:
    """``"value:ocdbt.process_0/:d/abc:10:20"`` -> ``"ocdbt.process_0/d/abc"``;
    ``"btreenode::d/abc:0:99"`` -> ``"d/abc"`` (kind, base path, file, offset, length)."""
    parts = location.split(":")
    if len(parts) < 5:
        return None
    return parts[1] + ":".join(parts[2:-2])


def _walk(ts, base, location: str, out: dict[str, set[str]]) -> None:
    """Record, for the files in ``out``, the arrays whose chunks the b-tree node at
    ``location`` (and its children) places in them; a node's own file is index: every array."""
    node = ts.ocdbt.dump(base, location).result()
    node_file = _file_of(location)
    if node_file in out:
        out[node_file].add("*")
    for entry in node.get("entries", []):
        child = next((v for v in entry.values() if isinstance(v, str)
                      and v.startswith("btreenode:")), None)
        if child is not None:
            _walk(ts, base, child, out)
        elif "indirect_value" in entry:
            f = _file_of(entry["indirect_value"])
            if f in out and "*" not in out[f]:
                key = entry.get("key", b"")
                name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
                out[f].add(name.rsplit("/", 1)[0])


# ---- messages and multi-process ------------------------------------------------------------
def describe(file: str, arrays: set[str] | None) -> str:
    """What a damaged file holds, for the message."""
    if file == "meta/metadata":
        return "it holds the step counter and the state's leaf list"
    if not file.startswith("state/"):
        return "it is orbax's bookkeeping of the step"
    if re.match(r"state/(d/|(ocdbt\.process_\d+/)?manifest\.ocdbt$)", file):
        return ("it is part of the state's index, which locates every array (and holds those "
                "under 1 KiB)")
    if not re.match(r"state/ocdbt\.process_\d+/d/", file):
        return "it is orbax's metadata of the state (tree, shardings, array layouts)"
    if arrays is None:
        return "it holds part of the state (its index could not be read to say which arrays)"
    if "*" in arrays or not arrays:   # no entry reads it: a process's own index
        return "it is part of the state's index, which locates every array"
    names = sorted(arrays)
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return f"it holds arrays {', '.join(names[:4])}{more}"


def paths_in(text: str) -> list[str]:
    return [m.rstrip("\"',.;)") for m in re.findall(r"(?:file://)?(/[^\s\"']+)", text)]


def part() -> tuple[int, int]:
    """This process's share of the files to check: (index, count)."""
    return jax.process_index(), jax.process_count()


def gathered(bad: dict[str, str], files) -> dict[str, str]:
    """Every process's damaged files among ``files`` (each checked its share), on every
    process."""
    if jax.process_count() == 1:
        return bad
    from jax.experimental import multihost_utils

    files = sorted(files)
    mine = np.array([f in bad for f in files], dtype=np.int32)
    everyone = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, len(files))
    return {f: bad.get(f, "did not match its record (checked by another process)")
            for f, hit in zip(files, everyone.max(axis=0)) if hit}
