"""The block store's files: one KV block per file, its key, header and checks. No state.

A block is the keys and values of every layer for up to ``BLOCK_TOKENS`` consecutive
tokens of one sequence. Its key is a hash chain: ``blake2b(parent key, its token ids)``,
where the first block's parent is a hash of the model's fingerprint; so one key names the
block *and every token before it*, and a lookup walks a prompt block by block.

A file is ``b-<key>-<crc>.safetensors`` (the CRC-32 of the whole file), written atomically
(``disk_format.write_atomic``). Its arrays are ``k.<layer>`` and ``v.<layer>``; its header
keeps the format, the model fingerprint, the mlx-lm version, the parent's key and the
block's token ids. A file is loaded only when its name, checksum, header, key (recomputed
from the parent and the ids) and every array's shape agree; anything else is removed and
counted by the caller, never loaded.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
import mlx.core as mx
import mlx_lm
import numpy as np

from worker import disk_format as fmt
from worker.disk_format import CorruptFile

BLOCK_FORMAT = "block-1"
FILE_PREFIX = "b-"
# Our header fields stand beside the arrays' names in the safetensors metadata.
META_PREFIX = "headroom_"
_NAME = re.compile(r"b-([0-9a-f]{32})-([0-9a-f]{8})\.safetensors")

# One layer's keys and values for the block's tokens: arrays of shape (1, heads, tokens, dim).
LayerKV = tuple[mx.array, mx.array]


def root_key(fingerprint: str) -> str:
    """The parent of every first block: no two models' blocks share a key."""
    return hashlib.blake2b(f"headroom-blocks/{fingerprint}".encode(), digest_size=16).hexdigest()


def block_key(parent: str, ids: np.ndarray) -> str:
    h = hashlib.blake2b(bytes.fromhex(parent), digest_size=16)
    h.update(np.asarray(ids, dtype="<i4").tobytes())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class BlockFile:
    key: str
    parent: str
    ids: np.ndarray             # the block's own token ids (int32)
    path: Path
    file_bytes: int
    data_bytes: int             # what loading it allocates
    mtime_ns: int


def write(directory: Path, key: str, parent: str, ids: np.ndarray, kv: Sequence[LayerKV], *,
          fingerprint: str) -> BlockFile:
    arrays: dict[str, mx.array] = {}
    for i, (k, v) in enumerate(kv):
        arrays[f"k.{i}"], arrays[f"v.{i}"] = k, v
    metadata = {"headroom_format": BLOCK_FORMAT, "headroom_fingerprint": fingerprint,
                "headroom_mlx_lm": mlx_lm.__version__, "headroom_parent": parent,
                "headroom_layers": str(len(kv)), "headroom_tokens": fmt.encode_ids(ids)}
    path, file_bytes, data_bytes = fmt.write_atomic(
        directory, key, lambda sink: mx.save_safetensors(sink, arrays, metadata),
        prefix=FILE_PREFIX, meta_prefix=META_PREFIX)
    return BlockFile(key, parent, np.asarray(ids, dtype=np.int32), path, file_bytes, data_bytes,
                     path.stat().st_mtime_ns)


def inspect(path: Path, fingerprint: str) -> BlockFile:
    """A block file's header, checked (not its data: ``read`` checks that)."""
    name = _NAME.fullmatch(path.name)
    if name is None:
        raise CorruptFile("not a block file name")
    metadata, data_bytes, file_bytes = fmt.parse_header(path, META_PREFIX)
    fmt.check_origin(metadata, BLOCK_FORMAT, fingerprint, prefix="")
    parent = metadata.get("parent") or ""
    if not re.fullmatch(r"[0-9a-f]{32}", parent) or not (metadata.get("layers") or "").isdigit():
        raise CorruptFile("incomplete metadata")
    ids = fmt.decode_ids(metadata.get("tokens"))
    if ids.size == 0 or block_key(parent, ids) != name[1]:
        raise CorruptFile("its key is not its parent's and token ids' hash")
    return BlockFile(name[1], parent, ids, path, file_bytes, data_bytes, path.stat().st_mtime_ns)


def read(info: BlockFile, *, fingerprint: str, num_layers: int) -> list[LayerKV]:
    """The block's arrays, evaluated. Raises CorruptFile, FileNotFoundError."""
    name = _NAME.fullmatch(info.path.name)
    if name is None:
        raise CorruptFile("not a block file name")
    fmt.check_checksum(info.path, name[2])
    try:
        arrays, metadata = mx.load(str(info.path), return_metadata=True)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as exc:
        raise CorruptFile(f"MLX cannot read it: {exc!r}") from None
    if metadata.get("headroom_parent") != info.parent or \
            not np.array_equal(fmt.decode_ids(metadata.get("headroom_tokens")), info.ids):
        raise CorruptFile("it changed since it was indexed")
    kv: list[LayerKV] = []
    for i in range(num_layers):
        k, v = arrays.get(f"k.{i}"), arrays.get(f"v.{i}")
        if k is None or v is None or k.ndim != 4 or v.ndim != 4 \
                or k.shape[2] != len(info.ids) or v.shape[2] != len(info.ids):
            raise CorruptFile(f"layer {i}'s arrays are missing or not {len(info.ids)} tokens long")
        kv.append((k, v))
    if len(arrays) != 2 * num_layers:
        raise CorruptFile(f"{len(arrays)} arrays where {num_layers} layers need {2 * num_layers}")
    mx.eval([a for pair in kv for a in pair])  # the read happens now, while its RAM is charged
    return kv


def scan(directory: Path, fingerprint: str) -> tuple[list[BlockFile], int]:
    """Trusted block files, least recently used first, and the untrusted ones removed."""
    return fmt.scan(directory, fingerprint, inspect)


def touch(info: BlockFile) -> None:
    fmt.touch(info.path)


def remove(info: BlockFile) -> None:
    fmt.remove(info.path)


def kv_nbytes(kv: Sequence[LayerKV]) -> int:
    return int(sum(k.nbytes + v.nbytes for k, v in kv))
