"""Checksums of offloaded KV blocks, so that a corrupt cache file is a miss, never wrong KV.

LMCache's fs_native disk tier hands back whatever bytes its files hold: overwriting them with
random bytes gave a full "hit" and different greedy output (measured with lmcache 0.5.6). The
worker therefore records a CRC32 of every block it gives LMCache, keyed by a chained hash of the
tokens up to the end of that block (plus model and cache salt), and checks the blocks LMCache
writes back before vLLM uses them. A mismatch is reported to vLLM as a failed block load, and
vLLM recomputes from that block on (vllm/v1/core/sched/scheduler.py ``_handle_invalid_blocks``,
with ``kv_load_failure_policy="recompute"`` set by the wiring).

Digests live in memory and, when the disk tier is on this machine, in an append-only file next
to it, so they survive restarts of LMCache and of vLLM. Blocks with no digest (another vLLM
instance stored them) are loaded unverified and counted. CPU KV only: on GPU the check would
copy every block to the host, so it is skipped there.
"""

from __future__ import annotations

import hashlib
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MAX_DIGESTS = 1 << 20


class BlockDigests:
    """key -> CRC32 of one block's KV over all layers; newest store wins (LRU-bounded)."""

    def __init__(self, path: Path | None, max_entries: int = MAX_DIGESTS) -> None:
        self.path = path
        self.max_entries = max_entries
        self._digests: OrderedDict[bytes, int] = OrderedDict()
        if path is not None and path.exists():
            for line in path.read_text().splitlines():
                key_hex, _, crc = line.partition(" ")
                try:
                    self._remember(bytes.fromhex(key_hex), int(crc))
                except ValueError:
                    continue  # a torn last line after a crash

    def record(self, entries: Sequence[tuple[bytes, int]]) -> None:
        for key, crc in entries:
            self._remember(key, crc)
        if self.path is not None and entries:
            with open(self.path, "a") as handle:
                handle.write("".join(f"{key.hex()} {crc}\n" for key, crc in entries))

    def check(self, key: bytes, crc: int) -> bool | None:
        """True: matches; False: corrupt; None: never recorded here."""
        known = self._digests.get(key)
        return None if known is None else known == crc

    def _remember(self, key: bytes, crc: int) -> None:
        self._digests[key] = crc
        self._digests.move_to_end(key)
        while len(self._digests) > self.max_entries:
            self._digests.popitem(last=False)


def block_keys(seed: str, token_ids: Sequence[int], block_size: int, end_block: int) -> list[bytes]:
    """Chained keys of blocks 0..end_block-1: block i's key covers every token before its end."""
    keys = []
    previous = hashlib.blake2b(seed.encode(), digest_size=16).digest()
    for block in range(end_block):
        tokens = token_ids[block * block_size:(block + 1) * block_size]
        data = previous + b"".join(int(t).to_bytes(4, "little") for t in tokens)
        previous = hashlib.blake2b(data, digest_size=16).digest()
        keys.append(previous)
    return keys


def block_crc(layers: Sequence[Any], block_id: int) -> int:
    """CRC32 of one block in every layer (vLLM CPU layout: [num_blocks, heads, block, 2*D])."""
    crc = 0
    for layer in layers:
        crc = zlib.crc32(layer[block_id].contiguous().view(-1).view(dtype=_uint8()).numpy(), crc)
    return crc


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
