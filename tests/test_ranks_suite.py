"""``benchmarks/ranks_suite.py``, issue 23's many-rank acceptance rows in one command: it launches ``ranks.py`` under
torchrun for every phase and reads their lines into one table. On the CPU (``-- --cpu``, tiny sizes) every phase runs
and is checked bit-exact; the table's ratios are taken within a round, and its targets are issue 23's at 4 ranks. No
time is asserted."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import ranks_suite as S  # noqa: E402

TINY = ["--cpu", "--steps", "2", "--batch", "8", "--max-len", "64", "--passes", "1"]


def test_the_suite_runs_every_phase_under_torchrun_and_tabulates_them(tmp_path, capsys, monkeypatch):
    # torchrun's rendezvous, the ranks' addresses and gloo's links on the loopback only
    monkeypatch.setattr(S, "LAUNCH", ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1"])
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    out = tmp_path / "rounds.json"
    assert S.main(["--ranks", "2", "--rounds", "1", "--dir", str(tmp_path / "d"), "--json", str(out), "--", *TINY]) == 0
    log = json.loads(out.read_text())
    assert log["ranks"] == 2
    got = [(x["phase"], x["ranks"], x.get("dumped_ranks"), x.get("bit-exact")) for x in log["rounds"]]
    assert got == [("write", 1, None, None), ("write", 2, None, None), ("replay", 1, 1, True), ("replay", 2, 2, True),
                   ("replay", 1, 2, True)]
    assert all(x["launch"].startswith("torchrun --rdzv-backend=c10d") for x in log["rounds"])
    assert log["rounds"][3]["decoded fraction (max over ranks)"] == 0.5  # each of 2 ranks decodes its own shard
    text = capsys.readouterr().out
    assert "| write, 2 ranks aggregate / 1 rank |" in text
    assert "| every phase ran, every replayed slice bit-exact | True |" in text
    assert not (tmp_path / "d" / "round0").exists()  # each round's dumps removed after it


def _round(n, w1, wn, r1, rn, ceiling, frac, exact=True):
    h = n // 2
    return {"write 1": {"GB/s": w1}, f"write {n}": {"GB/s": wn}, "replay 1 of 1": {"GB/s": r1, "bit-exact": True},
            f"replay {n} of {n}": {"GB/s": rn, "read_table GB/s (all cores, 1 process)": ceiling, "bit-exact": exact},
            f"replay {h} of {n}": {"GB/s": 1.0, "decoded fraction (max over ranks)": frac, "bit-exact": True}}


def test_ratios_are_taken_within_each_round_and_judged_at_four_ranks():
    # the host twice as fast in the second round, the third round's 4 ranks slowed down: the median of the rounds'
    # ratios is 3.2 (met); the ratio of the medians (3.2 / 2.0) would be 1.6
    rounds = [_round(4, 1.0, 3.2, 2.0, 6.4, 8.0, 0.5), _round(4, 2.0, 6.4, 4.0, 12.8, 16.0, 0.502),
              _round(4, 4.0, 3.0, 2.0, 6.4, 8.0, 0.5)]
    table = {name: (vals, target, met) for name, vals, target, met in S.rows(4, rounds)}
    vals, target, met = table["write, 4 ranks aggregate / 1 rank"]
    assert vals == [3.2, 3.2, 0.75] and target == ">= 3x" and met is True
    assert "| write, 4 ranks aggregate / 1 rank | 3.200 | 3.200 3.200 0.750 | >= 3x met |" in S.markdown(4, rounds)
    assert table["replay, 4 ranks aggregate / 1 rank"][2] is True
    assert table["replay, 4 ranks aggregate / read_table with all cores (1 process)"][0] == [0.8, 0.8, 0.8]
    assert table["replay, 2 of the 4-rank dump: decoded fraction, most of any rank"][2] is True
    slow = [_round(4, 1.0, 2.9, 2.0, 6.4, 9.0, 0.7)]
    table = {name: met for name, _, _, met in S.rows(4, slow)}
    assert table["write, 4 ranks aggregate / 1 rank"] is False
    assert table["replay, 4 ranks aggregate / read_table with all cores (1 process)"] is False
    assert table["replay, 2 of the 4-rank dump: decoded fraction, most of any rank"] is False
    # the issue states its targets for 4 ranks: at 2 they are not judged
    assert {met for _, _, _, met in S.rows(2, [_round(2, 1.0, 1.9, 2.0, 3.0, 4.0, 1.0)])} == {None}


def test_a_failed_phase_or_a_slice_that_differs_fails_the_suite():
    ok = _round(4, 1.0, 3.2, 2.0, 6.4, 8.0, 0.5)
    assert S.exact([ok])
    assert not S.exact([_round(4, 1.0, 3.2, 2.0, 6.4, 8.0, 0.5, exact=False)])
    failed = dict(ok)
    failed["write 4"] = {"rc": 1, "error": "boom"}  # no GB/s: its ratio is nan, not a number made up
    assert not S.exact([failed])
    vals = dict((name, v) for name, v, _, _ in S.rows(4, [failed]))["write, 4 ranks aggregate / 1 rank"]
    assert math.isnan(vals[0])
    assert "| every phase ran, every replayed slice bit-exact | False |" in S.markdown(4, [failed])


def test_one_rank_against_itself_is_refused(capsys):
    with pytest.raises(SystemExit) as e:  # before any launch
        S.main(["--ranks", "1", "--", *TINY])
    assert e.value.code == 2
    assert "--ranks must be >= 2" in capsys.readouterr().err
