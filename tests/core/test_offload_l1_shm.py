"""engine_driven's L1 in /dev/shm: the decision (room, no room, the mode), the reason lines, the
server's /config read back, and what the zero-copy check leaves for pools already there."""

from __future__ import annotations

import os
import shutil
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from kvops.core.offload.l1_shm import (
    L1Transfer,
    choose_l1_transfer,
    describe_l1,
    pool_name,
    remove_pool,
    reserved_bytes,
    served_l1,
    shm_room_bytes,
)
from kvops.core.offload.preflight import choose_transfer_mode
from kvops.core.offload.settings import OffloadSettings
from kvops.core.units import GIB

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def shm_free(monkeypatch: pytest.MonkeyPatch):
    """Set what ``shutil.disk_usage`` reports free for any path."""
    def set_free(free: int) -> None:
        monkeypatch.setattr(shutil, "disk_usage", lambda _path: Usage(free, 0, free))
    return set_free


def engine_driven(**kw: Any) -> OffloadSettings:
    return OffloadSettings(**{"port": 5601, "l1_gib": 1.0, "transfer_mode": "engine_driven", **kw})


def sparse(path: Path, size: int, filled: int = 0) -> Path:
    """A tmpfs-like pool: ``size`` reserved, ``filled`` bytes written."""
    with open(path, "wb") as handle:
        handle.write(b"\1" * filled)
        handle.truncate(size)
    return path


def test_engine_driven_shares_l1_under_a_name_of_its_port_when_shm_has_room(tmp_path, shm_free):
    shm_free(2 * GIB)
    choice = choose_l1_transfer(engine_driven(), tmp_path)
    assert choice == L1Transfer("lmcache_l1_pool_kvops_5601", choice.reason)
    assert choice.mode == "shm"
    assert f"L1 (1.00 GiB) shared through {tmp_path}/lmcache_l1_pool_kvops_5601" in choice.reason
    assert "the vLLM worker copies loads from it" in choice.reason


def test_engine_driven_pickles_and_says_why_when_shm_lacks_room(tmp_path, shm_free):
    shm_free(GIB // 2)
    choice = choose_l1_transfer(engine_driven(), tmp_path)
    assert choice.shm_name is None
    assert choice.mode == "pickled"
    assert choice.reason == (
        f"{tmp_path} has 0.50 GiB free beside the L1 pools there and L1 needs 1.00 GiB, so each "
        "L1 object is pickled through ZMQ (1-1.5% of memcpy): enlarge "
        f"{tmp_path} (docker --shm-size) or lower l1_gib")


def test_room_is_exactly_the_pool_size(tmp_path, shm_free):
    shm_free(GIB)
    assert choose_l1_transfer(engine_driven(), tmp_path).mode == "shm"
    shm_free(GIB - 1)
    assert choose_l1_transfer(engine_driven(), tmp_path).mode == "pickled"


def test_another_live_pool_keeps_what_it_has_not_filled_yet(tmp_path, shm_free):
    """Two pools promised the same sparse room: the one filling last would die of SIGBUS."""
    sparse(tmp_path / "lmcache_l1_pool_kvops_7000", 1 << 20, filled=1 << 16)
    unfilled = (1 << 20) - (1 << 16)
    shm_free(GIB + unfilled - 1)
    assert reserved_bytes(tmp_path) == unfilled
    assert shm_room_bytes(tmp_path) == GIB - 1
    assert choose_l1_transfer(engine_driven(), tmp_path).mode == "pickled"
    shm_free(GIB + unfilled)
    assert choose_l1_transfer(engine_driven(), tmp_path).mode == "shm"


def test_a_stale_pool_of_our_own_name_counts_as_room(tmp_path, shm_free):
    """LMCache unlinks a pool of its name before creating its own (l1_memory_manager.py:79)."""
    sparse(tmp_path / pool_name(5601), 1 << 20, filled=1 << 16)
    shm_free(GIB - (1 << 16))
    assert choose_l1_transfer(engine_driven(), tmp_path).mode == "shm"


def test_lmcache_driven_never_takes_a_pool(tmp_path, shm_free):
    shm_free(100 * GIB)
    choice = choose_l1_transfer(engine_driven(transfer_mode="lmcache_driven"), tmp_path)
    assert choice.shm_name is None
    assert "the server copies into vLLM's KV segment itself" in choice.reason


def test_auto_takes_a_pool_where_shm_has_room_and_says_vllm_will_copy_from_it(tmp_path, shm_free):
    shm_free(2 * GIB)
    choice = choose_l1_transfer(engine_driven(transfer_mode="auto"), tmp_path)
    assert choice.shm_name == pool_name(5601)
    assert "a CPU vLLM under auto takes engine_driven for it" in choice.reason


def test_auto_without_room_keeps_l1_private_and_says_zero_copy_comes_next(tmp_path, shm_free):
    shm_free(GIB // 2)
    choice = choose_l1_transfer(engine_driven(transfer_mode="auto"), tmp_path)
    assert choice.shm_name is None
    assert "takes zero-copy (lmcache_driven)" in choice.reason
    assert "docker --shm-size" in choice.reason
    assert "\n" not in choice.reason


def test_auto_on_a_cpu_takes_engine_driven_when_the_servers_l1_is_shared(tmp_path, shm_free):
    shm_free(100 * GIB)  # zero-copy would fit too: the shared L1 is what decides
    (tmp_path / pool_name(5601)).touch()
    shared = describe_l1(pool_name(5601), pool_name(5601), local=True, shm=tmp_path)
    choice = choose_transfer_mode("auto", "auto", GIB, "cpu", shm=tmp_path, shared_l1=shared.shm_name)
    assert choice.mode == "engine_driven"
    assert "copies loads itself" in choice.reason
    private = choose_transfer_mode("auto", "auto", GIB, "cpu", shm=tmp_path, shared_l1=None)
    assert private.mode == "lmcache_driven"
    assert "the server's L1 is not shared with this worker" in private.reason


@pytest.mark.parametrize(("server_mode", "device", "mode", "says"), [
    ("lmcache_driven", "cpu", "lmcache_driven", "accepts only lmcache_driven, so its shared L1 goes unused"),
    ("engine_driven", "cpu", "engine_driven", "copies loads itself"),
    ("auto", "cuda", "engine_driven", "the KV cache is on cuda"),
])
def test_a_shared_l1_moves_auto_only_on_a_cpu_server_that_takes_engine_driven(
        tmp_path, shm_free, server_mode, device, mode, says):
    shm_free(100 * GIB)
    choice = choose_transfer_mode("auto", server_mode, GIB, device, shm=tmp_path, shared_l1=pool_name(5601))
    assert (choice.mode, says in choice.reason) == (mode, True), choice.reason


def test_an_explicit_mode_is_kept_whatever_the_l1(tmp_path, shm_free):
    shm_free(100 * GIB)
    assert choose_transfer_mode("lmcache_driven", "auto", GIB, "cpu", shm=tmp_path,
                                shared_l1=pool_name(5601)).mode == "lmcache_driven"
    assert choose_transfer_mode("engine_driven", "auto", GIB, "cpu", shm=tmp_path).mode == "engine_driven"


def test_zero_copy_counts_the_room_an_l1_pool_will_still_fill(tmp_path, shm_free):
    shm_free(GIB)
    assert choose_transfer_mode("auto", "auto", GIB, "cpu", shm=tmp_path).mode == "lmcache_driven"
    sparse(tmp_path / "lmcache_l1_pool_kvops_7000", 1 << 20)
    choice = choose_transfer_mode("auto", "auto", GIB, "cpu", shm=tmp_path)
    assert choice.mode == "engine_driven"
    assert "docker --shm-size" in choice.reason


def test_an_unrelated_sparse_file_does_not_move_autos_choice(tmp_path, shm_free):
    shm_free(GIB)
    sparse(tmp_path / "psm_1234", 1 << 20)
    assert choose_transfer_mode("auto", "auto", GIB, "cpu", shm=tmp_path).mode == "lmcache_driven"


def test_remove_pool_frees_it_once(tmp_path):
    sparse(tmp_path / pool_name(5601), 1 << 20, filled=8192)
    assert remove_pool(pool_name(5601), tmp_path) >= 8192
    assert not (tmp_path / pool_name(5601)).exists()
    assert remove_pool(pool_name(5601), tmp_path) == 0


def recorded_config(asked: str, effective: str, use_lazy: bool = False) -> dict[str, Any]:
    """The parts of a real lmcache 0.5.6 /config (`lmcache server ... --shm-name kvops_probe`)."""
    return {
        "mp": {"port": 45551, "supported_transfer_mode": "auto", "shm_name": asked},
        "storage_manager": {"l1_manager_configs": [{"memory_config": {
            "size_in_bytes": 67108864, "use_lazy": use_lazy, "init_size_in_bytes": 67108864,
            "align_bytes": 4096, "shm_name": effective, "use_hugepages": False,
            "devdax_path": None, "devdax_size_in_bytes": 0}}]},
    }


def test_the_served_pool_is_read_back_with_lmcaches_prefix():
    assert served_l1(recorded_config("kvops_probe", "kvops_probe")) == (
        "kvops_probe", "lmcache_l1_pool_kvops_probe")
    assert served_l1(recorded_config(pool_name(1), pool_name(1)))[1] == pool_name(1)
    assert served_l1(recorded_config("x", "")) == ("x", "")  # LMCache found no room
    assert served_l1(recorded_config("x", "x", use_lazy=True)) == ("x", "")
    assert served_l1({"mp": {}}) == ("", "")  # a server from before --shm-name existed


def test_describe_l1_names_the_segment_or_why_loads_pickle(tmp_path):
    name = pool_name(5601)
    (tmp_path / name).touch()
    shared = describe_l1(name, name, local=True, shm=tmp_path)
    assert shared.mode == "shm"
    assert str(tmp_path / name) in shared.reason
    remote = describe_l1(name, name, local=False, shm=tmp_path)
    assert (remote.mode, "another host" in remote.reason) == ("pickled", True)
    gone = describe_l1(pool_name(5602), pool_name(5602), local=True, shm=tmp_path)
    assert "does not see" in gone.reason
    full = describe_l1("", name, local=True, shm=tmp_path)
    assert "LMCache found too little room" in full.reason
    plain = describe_l1("", "", local=True, shm=tmp_path)
    assert "runs without --shm-name" in plain.reason
    assert "for transfer_mode auto and engine_driven" in plain.reason
    for choice in (remote, gone, full, plain):
        assert choice.reason.startswith("L1 pickled: ")
        assert "pickled through ZMQ (1-1.5% of memcpy)" in choice.reason
        assert "\n" not in choice.reason


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_the_server_removes_its_pool_when_stopped(tmp_path):
    """LMCache unlinks it on a clean close; one killed at the end of the grace does not."""
    from kvops.ops.offload.server import LmcacheServer

    name = f"lmcache_l1_pool_kvops_unit{os.getpid()}"
    sparse(Path("/dev/shm") / name, 4096)
    server = LmcacheServer(name="lmcache", argv=["true"], port=1, log_path=tmp_path / "log",
                           env={}, l1=L1Transfer(name, "test"))
    server.stop()
    assert not (Path("/dev/shm") / name).exists()
