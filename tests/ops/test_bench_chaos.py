"""The chaos bench's report, counted from hand-made records (no server), and its options."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvops.core.errors import BadInputError
from kvops.ops.bench.chaos_faults import FAULTS, choose
from kvops.ops.bench.chaos_report import FaultRun, Probe, Sent, chaos_report, recovery_s
from kvops.ops.cli.main import app


def _sent(text: str | None, expected: tuple[str, ...] = ("ok", "ok."), error: str = "") -> Sent:
    return Sent(started=0.0, text=text, expected=expected, error=error)


def test_lost_and_wrong_are_counted_apart():
    sent = [_sent("ok"), _sent("ok."), _sent("bad"), _sent(None, error="HTTP 500"),
            _sent(None, error="ConnectionError"), _sent(None, error="HTTP 500")]
    run = FaultRun("disk_full", sent, cleared_at=10.0, probes=[Probe(12.5, True)], engine_crashes=0)
    report = chaos_report([run])
    fault = report["faults"][0]
    assert fault == {"name": "disk_full", "sent": 6, "answered": 3, "lost": 3, "wrong_outputs": 1,
                     "tie_flips": 0, "max_logprob_gap": 0.0, "engine_crashes": 0, "recovery_s": 2.5,
                     "lost_errors": ["ConnectionError", "HTTP 500"], "goal_met": False,
                     "wrong_examples": [{"prompt": -1, "got": "bad", "expected": ("ok", "ok."),
                                         "logprob_gaps": None}],
                     "tie_flip_examples": []}
    assert report["goal_met"] is False


def test_an_unexpected_text_greedy_up_to_a_tie_is_a_flip_not_wrong():
    """A text none of the oracle's: wrong when the reference scores a token of it more than a
    tie below the best (or it was not scored), a tie flip otherwise."""
    tie = Sent(0.0, "ok!", ("ok",), gaps=(0.0, 0.03125, 0.0))
    off = Sent(0.0, "no!", ("ok",), gaps=(0.0, 0.25, 0.0))
    fault = chaos_report([FaultRun("lmcache_stop", [tie, off, _sent("ok")], 0.0, [Probe(1.0, True)], 0)])
    fault = fault["faults"][0]
    assert (fault["wrong_outputs"], fault["tie_flips"], fault["max_logprob_gap"]) == (1, 1, 0.25)
    assert fault["wrong_examples"][0]["logprob_gaps"] == (0.0, 0.25, 0.0)
    assert fault["tie_flip_examples"][0]["got"] == "ok!"
    assert fault["goal_met"] is False


def test_recovery_starts_at_the_unbroken_healthy_run_that_reaches_the_last_probe():
    probes = [Probe(11.0, False), Probe(12.0, True), Probe(13.0, False), Probe(14.0, True), Probe(15.0, True)]
    assert recovery_s(10.0, probes) == 4.0
    assert recovery_s(10.0, [*probes, Probe(16.0, False)]) is None  # still unhealthy at the end
    assert recovery_s(10.0, []) is None
    assert recovery_s(10.0, [Probe(9.0, False), Probe(10.5, True)]) == 0.5  # probes before the clear ignored


def test_totals_and_goal_over_faults():
    clean = FaultRun("lmcache_kill", [_sent("ok")] * 4, 0.0, [Probe(1.0, True)], 0)
    crashed = FaultRun("lmcache_stop", [_sent("ok")] * 2, 0.0, [Probe(3.0, False)], 1)
    report = chaos_report([clean, crashed], fault_seconds=15.0)
    assert [f["goal_met"] for f in report["faults"]] == [True, False]
    assert report["totals"] == {"sent": 6, "answered": 6, "lost": 0, "wrong_outputs": 0, "engine_crashes": 1}
    assert report["faults"][1]["recovery_s"] is None
    assert report["fault_seconds"] == 15.0
    assert chaos_report([clean])["goal_met"] is True


def test_faults_option_names_a_subset_in_order_and_refuses_unknown_names():
    assert [f.name for f in choose("client_disconnects, lmcache_kill")] == ["client_disconnects", "lmcache_kill"]
    assert [f.name for f in choose(" lmcache_stop,,lmcache_stop")] == ["lmcache_stop"]
    assert {"none", "lmcache_kill", "lmcache_stop", "disk_full", "disk_read_only", "disk_deleted",
            "client_disconnects"} == set(FAULTS)
    with pytest.raises(BadInputError, match="unknown fault 'nope'"):
        choose("lmcache_kill,nope")


def test_chaos_options_on_another_bench_are_bad_input():
    result = CliRunner().invoke(app, ["bench", "planner", "--faults", "lmcache_kill"])
    assert result.exit_code == 2
    assert "--faults/--fault-seconds are for `kvops bench chaos`" in result.output


def test_an_unknown_chaos_transfer_mode_exits_2_naming_the_variable(monkeypatch):
    monkeypatch.setenv("KVOPS_BENCH_CHAOS_TRANSFER_MODE", "zero_copy")
    result = CliRunner().invoke(app, ["bench", "chaos", "--faults", "none", "--json"])
    assert result.exit_code == 2
    assert "KVOPS_BENCH_CHAOS_TRANSFER_MODE='zero_copy': use auto, engine_driven or lmcache_driven" in result.output
