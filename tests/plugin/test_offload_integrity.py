"""Block checksums: keys follow the whole prefix, a flipped byte is caught, digests persist."""

from __future__ import annotations

from pathlib import Path

import torch

from kvops.plugin.offload.integrity import BlockDigests, block_crc, block_keys, first_group_blocks


def test_keys_depend_on_every_earlier_token_and_the_seed():
    tokens = list(range(512))
    keys = block_keys("m|", tokens, 128, 4)
    assert len(set(keys)) == 4
    changed = tokens.copy()
    changed[5] = 999  # inside block 0: every later key changes too
    assert all(a != b for a, b in zip(keys, block_keys("m|", changed, 128, 4), strict=True))
    changed = tokens.copy()
    changed[300] = 999  # inside block 2: blocks 0-1 keep their keys
    other = block_keys("m|", changed, 128, 4)
    assert other[:2] == keys[:2]
    assert other[2:] != keys[2:]
    assert block_keys("other-model|", tokens, 128, 4)[0] != keys[0]


def test_crc_sees_one_flipped_byte_in_any_layer():
    layers = [torch.randn(6, 2, 128, 128).to(torch.bfloat16) for _ in range(3)]  # CPU layout
    before = block_crc(layers, 4)
    assert block_crc(layers, 4) == before
    assert block_crc(layers, 3) != before
    layers[2].view(torch.uint8).view(6, -1)[4, 1000] ^= 1
    assert block_crc(layers, 4) != before


def test_digests_survive_a_restart_and_report_unknown_blocks(tmp_path: Path):
    path = tmp_path / "l2.kvops-digests.rank0"
    digests = BlockDigests(path)
    digests.record([(b"k1" * 8, 11), (b"k2" * 8, 22)])
    digests.record([(b"k1" * 8, 12)])  # re-stored after an eviction: newest wins
    reloaded = BlockDigests(path)
    assert reloaded.check(b"k1" * 8, 12) is True
    assert reloaded.check(b"k1" * 8, 11) is False
    assert reloaded.check(b"k2" * 8, 22) is True
    assert reloaded.check(b"k3" * 8, 0) is None
    with open(path, "a") as handle:
        handle.write("zz")  # torn line after a crash
    assert BlockDigests(path).check(b"k2" * 8, 22) is True


def test_memory_is_bounded():
    digests = BlockDigests(None, max_entries=2)
    digests.record([(b"a", 1), (b"b", 2), (b"c", 3)])
    assert digests.check(b"a", 1) is None
    assert digests.check(b"c", 3) is True


def test_block_ids_of_the_first_group():
    assert first_group_blocks([[3, 4], [9]]) == [3, 4]
    assert first_group_blocks([3, 4]) == [3, 4]
    assert first_group_blocks([]) == []
