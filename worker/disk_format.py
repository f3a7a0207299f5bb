"""The disk tier's files: names, headers, checksums, atomic writes. No threads, no state.

A file is ``<key>-<crc>.safetensors``: ``key`` is the first 32 hex digits of sha256 over
the token ids (int32, little-endian), ``crc`` the CRC-32 of the whole file (8 hex digits).
The body is mlx-lm's ``save_prompt_cache`` format (safetensors; its metadata names the
cache classes), with ours beside it: format version, model fingerprint, mlx-lm version,
the token ids (base64 of int32 LE) and whether the cache can be trimmed. ``scan`` reads
headers only, so a restart indexes gigabytes of entries in milliseconds; ``read`` checks
the checksum before mlx-lm parses a byte of the file.

A write goes to ``.tmp-<pid>-<random>.safetensors``, is fsynced, then renamed: a crash
mid-write leaves a temporary file (removed by the next scan), never a trusted one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import logging
import os
import re
import secrets
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (can_trim_prompt_cache, load_prompt_cache, save_prompt_cache,
                                 trim_prompt_cache)

log = logging.getLogger(__name__)

FORMAT_VERSION = "1"
# save_prompt_cache flattens [our metadata, classes, scalars] into the header: ours is item 0.
META_PREFIX = "0."
MAX_HEADER_BYTES = 64 << 20
TMP_PREFIX = ".tmp-"
# A temporary file this old belongs to no write in progress, whoever's pid it names.
TMP_ABANDONED_S = 3600.0
_NAME = re.compile(r"([0-9a-f]{32})-([0-9a-f]{8})\.safetensors")
_SAFE_DIR = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHUNK_BYTES = 4 << 20


class CorruptFile(ValueError):
    """A cache file that must not be trusted: partial, damaged, foreign or stale.
    Recoverable: the caller removes the file and serves the request cold."""


@dataclass(frozen=True, slots=True)
class FileInfo:
    key: str
    path: Path
    ids: np.ndarray
    file_bytes: int
    data_bytes: int
    is_trimmable: bool
    mtime_ns: int


def as_ids(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    ids = np.asarray(tokens, dtype=np.int32)
    if ids.ndim != 1:
        raise ValueError(f"token ids must be one sequence, got shape {ids.shape}")
    return ids


def token_key(ids: np.ndarray) -> str:
    return hashlib.sha256(ids.astype("<i4").tobytes()).hexdigest()[:32]


def dir_name(fingerprint: str) -> str:
    """The fingerprint itself when it is a plain name, else a hash of it."""
    if _SAFE_DIR.fullmatch(fingerprint):
        return fingerprint
    return "fp-" + hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def check_and_eval(cache: list[Any], num_tokens: int) -> int:
    """Bytes of the cache's arrays, evaluated now (a no-op when they already are).

    Raises ValueError when a layer's offset says it covers other than ``num_tokens``
    tokens: a caller pairing a cache with the wrong ids would poison every later hit.
    """
    for layer in cache:
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int) and offset != num_tokens:
            raise ValueError(f"a {type(layer).__name__} holds {offset} tokens, not {num_tokens}")
    arrays = _arrays(cache)
    mx.eval(arrays)
    return sum(a.nbytes for a in arrays)


def is_trimmable(cache: list[Any]) -> bool:
    return bool(cache) and can_trim_prompt_cache(cache)


def header_bytes_estimate(num_tokens: int) -> int:
    return 4096 + 6 * num_tokens


def write(directory: Path, key: str, cache: list[Any], *, ids: np.ndarray, fingerprint: str,
          is_trimmable: bool) -> tuple[Path, int, int]:
    """Write atomically; returns (path, file bytes, tensor bytes)."""
    metadata = {"headroom_format": FORMAT_VERSION, "headroom_fingerprint": fingerprint,
                "headroom_mlx_lm": mlx_lm.__version__, "headroom_trimmable": "1" if is_trimmable else "0",
                "headroom_tokens": encode_ids(ids)}
    return write_atomic(directory, key, lambda sink: save_prompt_cache(sink, cache, metadata))


def write_atomic(directory: Path, key: str, save: Callable[[Any], None], *, prefix: str = "",
                 meta_prefix: str = META_PREFIX) -> tuple[Path, int, int]:
    """Write a safetensors file through ``save(file)`` to ``<prefix><key>-<crc>.safetensors``,
    atomically; returns (path, file bytes, tensor bytes)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)  # a user may delete it any time
    tmp = directory / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}.safetensors"
    try:
        # 0600: the ids are the user's prompt. Through a Python file object: MLX hands
        # over a tensor per write(), Python's write releases the GIL for the syscall, and
        # the checksum is taken on the way instead of by reading the file back.
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            sink = _ChecksumWriter(f)
            save(sink)
            f.flush()
            os.fsync(f.fileno())
        _, data_bytes, file_bytes = parse_header(tmp, meta_prefix)
        if file_bytes != sink.num_bytes:
            raise OSError(f"wrote {sink.num_bytes} bytes, the file has {file_bytes}")
        path = directory / f"{prefix}{key}-{sink.crc:08x}.safetensors"
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise
    _fsync_dir(directory)
    return path, file_bytes, data_bytes


def encode_ids(ids: np.ndarray) -> str:
    return base64.b64encode(ids.astype("<i4").tobytes()).decode("ascii")


def decode_ids(text: str | None) -> np.ndarray:
    try:
        raw = base64.b64decode(text or "", validate=True)
        return np.frombuffer(raw, dtype="<i4").astype(np.int32)
    except (ValueError, binascii.Error) as exc:
        raise CorruptFile(f"bad token ids: {exc!r}") from None


def check_checksum(path: Path, expected_crc: str) -> None:
    """Raises CorruptFile unless the file's CRC-32 is ``expected_crc`` (8 hex digits, from
    its name): checked before any parser reads a byte of it."""
    crc, _ = _checksum(path, sync=False)
    if int(expected_crc, 16) != crc:
        raise CorruptFile(f"checksum {crc:08x} does not match the name")


class _ChecksumWriter(io.RawIOBase):
    """A write-only file that passes bytes on to ``f`` and keeps their CRC-32 and count."""

    def __init__(self, f: io.BufferedWriter) -> None:
        super().__init__()
        self._f = f
        self.crc = 0
        self.num_bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.num_bytes += len(view)
        self._f.write(view)
        return len(view)


def read(path: Path, *, fingerprint: str, ids: np.ndarray) -> list[Any]:
    """The per-layer caches in ``path``, evaluated. Raises CorruptFile, FileNotFoundError;
    an allocation failure (RuntimeError from MLX) is the caller's, like any other."""
    name = _NAME.fullmatch(path.name)
    if name is None:
        raise CorruptFile("not a cache file name")
    check_checksum(path, name[2])
    try:
        cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CorruptFile(f"mlx-lm cannot read it: {exc!r}") from None
    except RuntimeError:
        # MLX says "Failed to open file" for a file removed since its checksum was read
        # (the writer made room, or a replica sharing the folder did): a miss, not a fault.
        if not path.exists():
            raise FileNotFoundError(path) from None
        raise
    stored, _ = check_metadata(metadata, fingerprint)
    if not np.array_equal(stored, ids):
        raise CorruptFile("its token ids changed since it was indexed")
    try:  # evaluated here: the read happens now, while its RAM is charged, not in a step
        check_and_eval(cache, len(ids))
    except ValueError as exc:
        raise CorruptFile(str(exc)) from None
    return cache


def trim(cache: list[Any], num_tokens: int) -> None:
    if num_tokens > 0:
        trim_prompt_cache(cache, num_tokens)


def scan(directory: Path, fingerprint: str,
         inspect_one: Callable[[Path, str], Any] | None = None) -> tuple[list[Any], int]:
    """Trusted files, least recently used first, and how many untrusted ones were removed.
    ``inspect_one(path, fingerprint)`` reads one file's header (``inspect``, or the block
    store's) into an info with ``key``, ``path`` and ``mtime_ns``, or raises CorruptFile."""
    inspect_one = inspect_one or inspect
    found: dict[str, Any] = {}
    num_bad = 0
    for path in directory.iterdir():
        if path.name.startswith(TMP_PREFIX):
            if _is_abandoned(path):
                remove(path)
                num_bad += 1
            continue
        try:
            if not path.is_file():
                continue  # not ours to judge
            info = inspect_one(path, fingerprint)
        except FileNotFoundError:
            continue
        except (CorruptFile, OSError) as exc:
            log.warning("prompt cache: removing untrusted %s: %s", path.name, exc)
            remove(path)
            num_bad += 1
            continue
        older = found.get(info.key)
        if older is not None:  # two writers of the same ids: keep the newer copy
            older, info = sorted((older, info), key=lambda i: i.mtime_ns)
            remove(older.path)
        found[info.key] = info
    return sorted(found.values(), key=lambda i: i.mtime_ns), num_bad


def inspect(path: Path, fingerprint: str) -> FileInfo:
    name = _NAME.fullmatch(path.name)
    if name is None:
        raise CorruptFile("not a cache file name")
    metadata, data_bytes, file_bytes = parse_header(path)
    ids, trimmable = check_metadata(metadata, fingerprint)
    if token_key(ids) != name[1]:
        raise CorruptFile("its token ids do not match its name")
    return FileInfo(name[1], path, ids, file_bytes, data_bytes, trimmable, path.stat().st_mtime_ns)


def parse_header(path: Path, meta_prefix: str = META_PREFIX) -> tuple[dict[str, str], int, int]:
    """(our metadata, tensor bytes, file bytes) from a safetensors header, checked against
    the file's size, so a truncated or padded file is caught without reading its data."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CorruptFile("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise CorruptFile("its header runs past the end")
        try:
            header = json.loads(f.read(length))
            metadata = header.pop("__metadata__", {})
            spans = [(int(t["data_offsets"][0]), int(t["data_offsets"][1])) for t in header.values()]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise CorruptFile(f"not a safetensors header: {exc!r}") from None
    end = max((stop for _, stop in spans), default=0)
    if 8 + length + end != size or any(not 0 <= a <= b for a, b in spans):
        raise CorruptFile(f"{size} bytes where its header says {8 + length + end}")
    ours = {k[len(meta_prefix):]: v for k, v in metadata.items() if k.startswith(meta_prefix)}
    return ours, sum(b - a for a, b in spans), size


def check_metadata(metadata: dict[str, str], fingerprint: str) -> tuple[np.ndarray, bool]:
    """(token ids, is trimmable) when the file is ours, of this model and this mlx-lm."""
    check_origin(metadata, FORMAT_VERSION, fingerprint, prefix="headroom_")
    ids = decode_ids(metadata.get("headroom_tokens"))
    if ids.size == 0 or metadata.get("headroom_trimmable") not in ("0", "1"):
        raise CorruptFile("incomplete metadata")
    return ids, metadata["headroom_trimmable"] == "1"


def check_origin(metadata: dict[str, str], version: str, fingerprint: str, *, prefix: str) -> None:
    """Raises CorruptFile unless the header says: ours, this format ``version``, this model,
    this mlx-lm (``prefix``: how the header names our fields)."""
    if metadata.get(f"{prefix}format") != version:
        raise CorruptFile("not a Headroom prompt cache file of this format")
    if metadata.get(f"{prefix}fingerprint") != fingerprint:
        raise CorruptFile(f"another model's (fingerprint {metadata.get(f'{prefix}fingerprint')!r})")
    if metadata.get(f"{prefix}mlx_lm") != mlx_lm.__version__:
        raise CorruptFile(f"written by mlx-lm {metadata.get(f'{prefix}mlx_lm')!r}")


def touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # removed meanwhile: the next lookup finds out


def remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("prompt cache: could not remove %s: %s", path, exc)


def _arrays(cache: list[Any]) -> list[mx.array]:
    return [v for _, v in tree_flatten([layer.state for layer in cache]) if isinstance(v, mx.array)]


def _checksum(path: Path, *, sync: bool) -> tuple[int, int]:
    """(CRC-32, size) of the file, read in chunks (zlib releases the GIL on each)."""
    crc, size = 0, 0
    buf = bytearray(_CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
        if sync:
            os.fsync(f.fileno())
    return crc, size


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX keeps it in the directory's metadata)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_abandoned(path: Path) -> bool:
    """A temporary file whose writer is gone (or that is too old to be in progress)."""
    try:
        pid = int(path.name[len(TMP_PREFIX):].split("-", 1)[0])
        age_s = time.time() - path.stat().st_mtime
    except (ValueError, OSError):
        return True
    if pid <= 0 or pid == os.getpid() or age_s > TMP_ABANDONED_S:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
