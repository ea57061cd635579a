"""Block checksums: keys follow the whole prefix, a flipped byte is caught, digests persist."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from kvops.core.offload.settings import DIGEST_HEADER, DIGEST_LINE_BYTES
from kvops.plugin.offload.integrity import BlockDigests, BlockHasher, block_keys, first_group_blocks


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


def test_digest_sees_one_flipped_byte_in_any_layer_written_after_it_was_set_up():
    layers = [torch.randn(6, 2, 128, 128).to(torch.bfloat16) for _ in range(3)]  # CPU layout
    digest_of = BlockHasher(layers)  # reads the layers in place: later writes count
    before = digest_of(4)
    assert digest_of(4) == before
    assert digest_of(3) != before
    layers[2].view(torch.uint8).view(6, -1)[4, 1000] ^= 1
    assert digest_of(4) != before
    layers[2].view(torch.uint8).view(6, -1)[4, 1000] ^= 1
    assert digest_of(4) == before


def test_a_layer_not_laid_out_densely_digests_the_same_bytes():
    dense = [torch.randn(6, 2, 16, 64).to(torch.bfloat16) for _ in range(2)]
    # the same values, held block-last in memory: a [num_blocks, ...] view of it is strided
    strided = [layer.permute(1, 2, 3, 0).contiguous().permute(3, 0, 1, 2) for layer in dense]
    assert not strided[0].is_contiguous()
    assert [BlockHasher(strided)(b) for b in range(6)] == [BlockHasher(dense)(b) for b in range(6)]


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


KEY = b"k" * 16


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_the_file_is_compacted_at_its_budget_and_keeps_the_newest(tmp_path: Path):
    path = tmp_path / "l2.kvops-digests.rank0"
    budget = DIGEST_LINE_BYTES * 40  # 20 entries in memory, 40 lines on disk
    digests = BlockDigests(path, max_file_bytes=budget)
    for i in range(500):
        digests.record([(_key(i), (1 << 64) - 1 - i)])  # the widest digests
        assert path.stat().st_size <= budget
    assert path.read_text().startswith(DIGEST_HEADER)
    reloaded = BlockDigests(path, max_file_bytes=budget)
    assert reloaded.check(_key(499), (1 << 64) - 500) is True
    assert reloaded.check(_key(0), (1 << 64) - 1) is None
    assert len(reloaded) <= 20


@pytest.mark.parametrize("content", [
    b"\xff\xfe\x00garbage" * 10,  # not text (used to crash the worker with UnicodeDecodeError)
    b"hello world\nnot digests\nat all\n",  # text, but not ours
    f"{KEY.hex()} 1\n{(b'j' * 16).hex()} 4294967295\n".encode(),  # CRC32s of an earlier kvops
])
def test_a_corrupt_file_is_discarded_with_a_warning(tmp_path: Path, content: bytes,
                                                     caplog: pytest.LogCaptureFixture):
    path = tmp_path / "l2.kvops-digests.rank0"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.kvops.offload"):
        digests = BlockDigests(path)
    assert "discarding the block digest file" in caplog.text
    assert not path.exists()
    assert len(digests) == 0
    digests.record([(KEY, 1)])
    assert BlockDigests(path).check(KEY, 1) is True


def test_an_oversized_file_is_discarded_without_reading_it(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture):
    path = tmp_path / "l2.kvops-digests.rank0"
    path.write_text(DIGEST_HEADER + f"{KEY.hex()} 1\n" * 100)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.kvops.offload"):
        digests = BlockDigests(path, max_file_bytes=DIGEST_LINE_BYTES * 10)
    assert "above its 540-byte budget" in caplog.text
    assert digests.check(KEY, 1) is None


def test_a_write_that_fails_degrades_once_never_raises_and_recovers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """The directory vanishes under the store (a real FileNotFoundError from open())."""
    import kvops.plugin.offload.integrity as integrity

    monkeypatch.setattr(integrity, "RETRY_S", 0.0)
    folder = tmp_path / "tier"
    folder.mkdir()
    path = folder / "l2.kvops-digests.rank0"
    digests = BlockDigests(path)
    digests.record([(_key(1), 1)])
    folder.joinpath(path.name).unlink()
    folder.rmdir()
    with caplog.at_level(logging.ERROR, logger="vllm.plugins.kvops.offload"):
        digests.record([(_key(2), 2)])
        digests.record([(_key(3), 3)])
    assert digests.problem is not None
    assert caplog.text.count("DIGEST STORE DEGRADED") == 1
    assert digests.check(_key(3), 3) is True  # memory still verifies
    folder.mkdir()
    digests.record([(_key(4), 4)])
    assert digests.problem is None
    reloaded = BlockDigests(path)
    assert [reloaded.check(_key(i), i) for i in (1, 2, 3, 4)] == [True] * 4  # rewritten whole


def test_the_preflight_counts_the_digest_budget(tmp_path: Path):
    from kvops.core.errors import KvopsPluginError
    from kvops.core.offload.preflight import check_disk_dir

    free_gib = shutil.disk_usage(tmp_path).free / (1 << 30)
    with pytest.raises(KvopsPluginError, match="of block checksums beside it"):
        check_disk_dir(str(tmp_path / "tier"), free_gib * 0.999)
