"""Checksums of offloaded KV blocks, so that a corrupt cache file is a miss, never wrong KV.

LMCache's fs_native disk tier hands back whatever bytes its files hold: overwriting them with
random bytes gave a full "hit" and different greedy output (measured with lmcache 0.5.6). The
worker therefore records a digest (xxh3_64) of every block it gives LMCache, keyed by a chained
hash of the tokens up to the end of that block (plus model and cache salt), and checks the blocks
LMCache writes back before vLLM uses them. The digest runs inside vLLM's step on the TTFT path of
every store and load: xxh3 reads vLLM's KV in place at ~8 GB/s here, where the zlib CRC32 of
earlier kvops ran at ~2.4 GB/s (~25 ms of a 2,048-token load of the offload bench's model). A
mismatch is reported to vLLM as a failed block load, and vLLM recomputes from that block on
(vllm/v1/core/sched/scheduler.py ``_handle_invalid_blocks``, with
``kv_load_failure_policy="recompute"`` set by the wiring).

Digests live in memory and, when the disk tier is on this machine, in an append-only file next
to it (bounded, compacted, counted in the disk budget), so they survive restarts of LMCache and
of vLLM. Blocks with no digest (another vLLM
instance stored them) are loaded unverified and counted. CPU KV only: on GPU the check would
copy every block to the host, so it is skipped there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from kvops.core.offload.settings import DIGEST_HEADER, DIGEST_LINE_BYTES, digest_budget_bytes

logger = logging.getLogger("vllm.plugins.kvops.offload")

MAX_DIGESTS = 1 << 20
KEY_BYTES = 16  # block_keys: blake2b digest_size
RETRY_S = 5.0
"""While the digest file refuses writes, how often a store tries it again (a full rewrite)."""


class BlockDigests:
    """key -> xxh3_64 of one block's KV over all layers; newest store wins (LRU-bounded).

    The file is bounded: when it reaches ``max_file_bytes`` it is rewritten from the entries in
    memory (at most half of that), so it costs at most ``digest_budget_bytes(disk_gib)``, which
    the disk preflight counts on top of ``disk_gib``. Its I/O runs inside vLLM's step
    (``wait_for_save``), so it never raises: a write that fails (ENOSPC, EROFS, the directory
    gone) turns the store memory-only, logged once, ``problem`` set (the connector publishes it
    as ``kvops_offload_digest_degraded``); a later store retries and recovers. The file opens
    with DIGEST_HEADER: one without it holds CRC32s of an older kvops (or is not ours) and is
    discarded, since its digests would call every block it lists corrupt.
    """

    def __init__(self, path: Path | None, max_entries: int = MAX_DIGESTS,
                 max_file_bytes: int | None = None) -> None:
        self.path = path
        self.max_file_bytes = max_file_bytes or digest_budget_bytes(None)
        per_file = self.max_file_bytes // (2 * DIGEST_LINE_BYTES)
        self.max_entries = max(1, min(max_entries, per_file) if path is not None else max_entries)
        self._digests: OrderedDict[bytes, int] = OrderedDict()
        self._file_bytes = 0
        self.problem: str | None = None
        self._retry_at = 0.0
        self.failures = 0
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        """Read the file back; one that is oversized, not text or not ours is discarded loudly."""
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        except OSError as exc:
            self._fail(f"cannot read it ({exc.strerror or exc})")
            return
        if size > self.max_file_bytes:
            self._discard(path, f"{size} bytes, above its {self.max_file_bytes}-byte budget")
            return
        try:
            text = path.read_bytes().decode("ascii")
        except UnicodeDecodeError:
            self._discard(path, "not a digest file (binary content)")
            return
        except OSError as exc:
            self._fail(f"cannot read it ({exc.strerror or exc})")
            return
        lines = text.splitlines()
        if not lines:
            return
        if lines[0] != DIGEST_HEADER.rstrip("\n"):
            self._discard(path, "no xxh3 header: CRC32 digests of an older kvops, or not ours")
            return
        bad = 0
        for line in lines[1:]:
            key_hex, _, digest = line.partition(" ")
            try:
                self._remember(_key(key_hex), _digest(digest))
            except ValueError:
                bad += 1
        if bad > 1:  # one torn last line is a crash; more is not a file we wrote
            self._digests.clear()
            self._discard(path, f"{bad} of {len(lines)} lines are not digests")
            return
        self._file_bytes = size

    def _discard(self, path: Path, why: str) -> None:
        logger.warning("kvops offload: discarding the block digest file %s (%s); blocks stored "
                       "before now load unverified (kvops_offload_unverified_blocks)", path, why)
        try:
            path.unlink()
        except OSError as exc:
            self._fail(f"cannot remove it ({exc.strerror or exc})")

    def record(self, entries: Sequence[tuple[bytes, int]]) -> None:
        for key, digest in entries:
            self._remember(key, digest)
        if self.path is None or not entries:
            return
        if self.problem is not None:
            if time.monotonic() < self._retry_at:
                return
            self._rewrite()  # the file missed what was recorded while it failed
            return
        text = "".join(f"{key.hex()} {digest}\n" for key, digest in entries)
        if self._file_bytes + len(text) > self.max_file_bytes:
            self._rewrite()
            return
        try:
            with open(self.path, "a") as handle:
                if handle.tell() == 0:  # new, or removed under us: a file of ours starts so
                    text = DIGEST_HEADER + text
                handle.write(text)
        except OSError as exc:
            self._fail(exc.strerror or str(exc))
            return
        self._file_bytes += len(text)

    def _rewrite(self) -> None:
        """Compact: the entries in memory into a temporary file, renamed over the old one."""
        assert self.path is not None
        tmp = self.path.with_name(self.path.name + ".tmp")
        text = DIGEST_HEADER + "".join(f"{key.hex()} {digest}\n" for key, digest in self._digests.items())
        try:
            with open(tmp, "w") as handle:
                handle.write(text)
            os.replace(tmp, self.path)
        except OSError as exc:
            _remove_quietly(tmp)
            self._fail(exc.strerror or str(exc))
            return
        self._file_bytes = len(text)
        if self.problem is not None:
            logger.warning("kvops offload: the block digest file %s takes writes again "
                           "(kvops_offload_digest_degraded=0)", self.path)
            self.problem = None

    def _fail(self, why: str) -> None:
        self.failures += 1
        self._retry_at = time.monotonic() + RETRY_S
        if self.problem is None:
            logger.error(
                "kvops offload DIGEST STORE DEGRADED: the block digest file %s refuses writes "
                "(%s); digests stay in memory only and blocks stored now load unverified after "
                "a restart; serving continues (kvops_offload_digest_degraded=1): free space or "
                "remount it read-write", self.path, why)
        self.problem = why

    def check(self, key: bytes, digest: int) -> bool | None:
        """True: matches; False: corrupt; None: never recorded here."""
        known = self._digests.get(key)
        return None if known is None else known == digest

    def _remember(self, key: bytes, digest: int) -> None:
        self._digests[key] = digest
        self._digests.move_to_end(key)
        while len(self._digests) > self.max_entries:
            self._digests.popitem(last=False)

    def __len__(self) -> int:
        return len(self._digests)


def _digest(text: str) -> int:
    value = int(text)
    if not 0 <= value < 1 << 64:
        raise ValueError(text)
    return value


def _key(text: str) -> bytes:
    key = bytes.fromhex(text)
    if len(key) != KEY_BYTES:
        raise ValueError(text)
    return key


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only filesystem: nothing was written there either


def block_keys(seed: str, token_ids: Sequence[int], block_size: int, end_block: int) -> list[bytes]:
    """Chained keys of blocks 0..end_block-1: block i's key covers every token before its end."""
    keys = []
    previous = hashlib.blake2b(seed.encode(), digest_size=KEY_BYTES).digest()
    for block in range(end_block):
        tokens = token_ids[block * block_size:(block + 1) * block_size]
        data = previous + b"".join(int(t).to_bytes(4, "little") for t in tokens)
        previous = hashlib.blake2b(data, digest_size=KEY_BYTES).digest()
        keys.append(previous)
    return keys


class BlockHasher:
    """xxh3_64 of one block over every layer (vLLM CPU layout: [num_blocks, heads, block, 2*D]).

    A contiguous layer is read in place through a [num_blocks, bytes] uint8 view made once; a
    layer vLLM laid out otherwise is copied block by block (``contiguous()``), as before.
    """

    def __init__(self, layers: Sequence[Any]) -> None:
        self._layers = list(layers)
        self._rows = [block_rows(layer) for layer in self._layers]

    def __call__(self, block_id: int) -> int:
        digest = xxhash.xxh3_64()
        for layer, rows in zip(self._layers, self._rows, strict=True):
            digest.update(rows[block_id] if rows is not None
                          else layer[block_id].contiguous().view(-1).view(dtype=_uint8()).numpy())
        return digest.intdigest()


def block_rows(layer: Any) -> Any:
    """``layer`` as a [num_blocks, bytes of one block] uint8 numpy view sharing its memory, or
    None when its memory is not one dense run (a view would then be a copy, soon stale)."""
    if not layer.is_contiguous() or layer.dim() < 2:
        return None
    return layer.view(dtype=_uint8()).view(layer.shape[0], -1).numpy()


def _uint8() -> Any:
    import torch

    return torch.uint8


def first_group_blocks(block_ids: Any) -> list[int]:
    """The block ids of KV group 0 (LMCache sends ``[[...]]``, IPC may flatten it to ``[...]``)."""
    if not block_ids:
        return []
    if isinstance(block_ids[0], int):
        return list(block_ids)
    return list(block_ids[0])
