"""The installed ``trajstore`` console script, run in a subprocess (output piped: plain text)."""

import json
import os
import subprocess
import sys

import pytest
from _dumps import CONVERSATIONS, list_dump, make_tokenizer, padded_dump, run, run_here


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    tok = make_tokenizer(d)
    written = padded_dump(d / "a", tok, steps=(0, 1, 2, 5))
    padded_dump(d / "b", tok, steps=(0, 1, 2, 5), perturb=(2, 1, 3, 0.25))
    padded_dump(d / "c", tok, steps=(0, 1, 2, 5))
    list_dump(d / "a", tok, steps=(0, 3), split="val")
    return d, tok, written


def test_info_json(data):
    d, _, written = data
    info = json.loads(run("info", d / "a", "--json").stdout)
    assert set(info["splits"]) == {"train", "val"}
    tr = info["splits"]["train"]
    assert tr["steps"] == {"count": 4, "first": 0, "last": 5, "gaps": [[3, 4]]}
    assert [p["step"] for p in tr["per_step"]] == [0, 1, 2, 5]
    assert all(p["rows"] == 3 and p["bytes"] > 0 for p in tr["per_step"])
    n_tok = int(written[0]["attention_mask"].sum())
    assert all(p["tokens"] == n_tok for p in tr["per_step"]) and tr["tokens"] == 4 * n_tok
    f = {x["name"]: x for x in tr["fields"]}
    assert (f["input_ids"]["dtype"], f["input_ids"]["kind"]) == ("int64", "token")
    assert (f["rewards"]["dtype"], f["rewards"]["kind"]) == ("float32", "sample")
    assert (f["uid"]["dtype"], f["uid"]["kind"]) == ("str", "sample")
    assert f["logprobs"]["steps"] == 4
    val = info["splits"]["val"]
    assert val["steps"]["gaps"] == [[1, 2]] and val["rows"] == 6
    assert {x["name"] for x in val["fields"]} >= {"prompt_ids", "response_ids", "reward"}
    assert info["environment"]["python"] and info["format_version"] == 2  # the manifest: layout 2
    only = json.loads(run("info", d / "a", "--json", "--split", "val").stdout)
    assert list(only["splits"]) == ["val"]


def test_info_text(data):
    d, _, _ = data
    out = run("info", d / "a").stdout
    assert "split train" in out and "gaps 3-4" in out and "input_ids" in out and "\x1b[" not in out


def test_show_gives_back_the_strings(data):
    d, tok, _ = data
    out = run("show", d / "a", "--step", 1, "--sample", 0, "--tokenizer", tok).stdout
    for role, text in CONVERSATIONS[0]:
        assert f"--- {role} (" in out and text.strip() in out
    assert "reward 2.0" in out and "versions 4x" in out
    js = json.loads(run_here("show", d / "a", "--step", 5, "--sample", 2, "--tokenizer", tok, "--json").stdout)
    assert js["prompt"] == CONVERSATIONS[2][0][1] and js["completion"] == CONVERSATIONS[2][1][1]
    lp = run_here("show", d / "a", "--step", 1, "--tokenizer", tok, "--logprobs").stdout
    assert "per-token log-probabilities" in lp and "' answer'" in lp


def test_show_without_tokenizer_and_rejected(data):
    d, _, written = data
    out = run("show", d / "a", "--step", 0, "--sample", 1).stdout
    ids = written[0]["input_ids"][1][written[0]["attention_mask"][1]].tolist()
    assert " ".join(map(str, ids[:5])) in out
    rej = run_here("show", d / "a", "--split", "val", "--step", 3, "--sample", 1)
    assert "rejected" in rej.stdout
    bad = run_here("show", d / "a", "--step", 0, "--sample", 9, check_rc=2)
    assert "out of range" in bad.stderr


def test_diff_exit_codes(data):
    """The console script's exit codes (0 identical, 1 different, 2 an error), then the options run
    in this process (``run_here``: the same command line, its output captured)."""
    d, _, _ = data
    same = run("diff", d / "a", d / "c")
    assert "identical" in same.stdout
    p = run("diff", d / "a", d / "b", check_rc=1)
    assert p.stdout == run_here("diff", d / "a", d / "b", check_rc=1).stdout
    assert "first divergence (differs): step 2 field logprobs traj 1 tok 3: " in p.stdout
    assert "logprobs: first beyond tolerance at step 2 traj 1 tok 3" in p.stdout
    assert "old_logprobs: first" not in p.stdout
    js = json.loads(run_here("diff", d / "a", d / "b", "--json", check_rc=1).stdout)
    fd = js["first_divergence"]
    assert (fd["step"], fd["field"], fd["trajectory"], fd["token"]) == (2, "logprobs", 1, 3)
    assert js["fields"]["input_ids"]["status"] == "identical"
    run_here("diff", d / "a", d / "b", "--atol", "0.3")
    run_here("diff", d / "a", d / "b", "--steps", "0-1,5")
    run_here("diff", d / "a", d / "b", "--fields", "input_ids,rewards")
    # b's logprobs differ from its old_logprobs at trajectory 1, token 3: a prompt token (loss mask 0)
    pair = run_here("diff", d / "b", "--pair", "logprobs", "old_logprobs", check_rc=1)
    assert "logprobs vs old_logprobs" in pair.stdout and "p99 abs" in pair.stdout
    assert "step 2 traj 1 tok 3" in pair.stdout
    masked = run_here("diff", d / "b", "--pair", "logprobs", "old_logprobs", "--mask", "loss_mask")
    assert masked.stdout.rstrip().endswith("identical")
    run_here("diff", d / "a", "--pair", "logprobs", "old_logprobs")
    err = run("diff", d / "a", d / "nope", check_rc=2)
    assert "no trajstore dump" in err.stderr


def test_sql(data):
    d, _, written = data
    q = "SELECT step, avg(rewards) AS r FROM train GROUP BY step ORDER BY step"
    rows = [json.loads(x) for x in run("sql", d / "a", q, "--format", "json").stdout.splitlines()]
    want = {s: float(b["rewards"].double().mean()) for s, b in written.items()}
    assert [r["step"] for r in rows] == sorted(want)
    assert all(r["r"] == pytest.approx(want[r["step"]]) for r in rows)
    csv = run("sql", d / "a", "SELECT count(*) AS n FROM val", "--format", "csv").stdout.splitlines()
    assert csv == ["n", "6"]
    table = run("sql", d / "a", q).stdout.splitlines()
    assert table[0].split() == ["step", "r"] and len(table) == 5
    err = run("sql", d / "a", "SELECT * FROM nope", check_rc=2)
    assert "train" in err.stderr and "val" in err.stderr


def test_export_jsonl(data, tmp_path):
    d, tok, _ = data
    p = run("export", d / "a", "--split", "val", "--format", "jsonl", "--tokenizer", tok)
    recs = [json.loads(x) for x in p.stdout.splitlines()]
    assert len(recs) == 4 and not any(r["rejected"] for r in recs)
    assert "2 rejected skipped" in p.stderr
    assert [(r["prompt"], r["completion"]) for r in recs[:2]] == [(c[0][1], c[1][1]) for c in CONVERSATIONS[1:]]
    out = tmp_path / "t.jsonl"
    p = run_here("export", d / "a", "--tokenizer", tok, "--max-per-step", 1, "--steps", "1-2", "-o", out)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["step"], r["index"]) for r in recs] == [(1, 0), (2, 0)]
    assert [(m["role"], m["text"]) for m in recs[0]["messages"]] == list(CONVERSATIONS[0])
    inc = run_here("export", d / "a", "--split", "val", "--include-rejected").stdout.splitlines()
    assert sum(json.loads(x)["rejected"] for x in inc) == 2


def test_usage_errors(data):
    d, _, _ = data
    assert run("--version").stdout.startswith("trajstore ")
    run("show", d / "a", check_rc=2)  # --step is required
    err = run("show", d / "a", "--step", 7, check_rc=2)
    assert "step 7" in err.stderr
    run("info", d / "missing", check_rc=2)


def test_export_trackio_offline(data, tmp_path):
    pytest.importorskip("trackio")
    d, tok, _ = data
    env = {"TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    p = run("export", d / "a", "--split", "val", "--format", "trackio", "--tokenizer", tok,
            "--project", "proj", "--run", "r1", env=env)
    assert "logged 4 trajectories from 2 step(s) to Trackio; 2 rejected counted" in p.stderr
    code = ("import json; from trackio.sqlite_storage import SQLiteStorage as S; "
            "print(json.dumps([[t['step'], t['messages'], t['metadata']] for t in S.get_traces('proj', run='r1')]))")
    got = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    env={**os.environ, **env}).stdout)
    assert sorted((s, m["index"]) for s, _, m in got) == [(0, 0), (0, 2), (3, 0), (3, 2)]
    by = {(s, m["index"]): msgs for s, msgs, m in got}
    assert by[(3, 2)] == [{"role": "user", "content": CONVERSATIONS[2][0][1]},
                          {"role": "assistant", "content": CONVERSATIONS[2][1][1]}]
