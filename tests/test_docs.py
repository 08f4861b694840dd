"""Every command and snippet of README.md, docs/**.md and examples/README.md runs (issue 16).

The fenced blocks of those files whose language is ``bash``/``sh``/``shell``, ``python`` or ``sql``
are run against the demo's dump, built once per session by the README's first command (its
``examples/demo.py`` part, into a temporary folder), from a working folder where the README's paths
resolve: ``dumps/demo`` (the demo's dump), ``examples`` (the checkout's), and ``python``,
``python3`` and ``trajstore`` on the PATH running this checkout. Blocks without a language (file
trees, the error hierarchy) are not commands and are not run.

* bash blocks run as one ``bash -e -o pipefail`` script each, and must exit 0;
* python blocks run in this process, those of one file in ONE namespace, in the file's order (like a
  notebook: a later block may use what an earlier one defined); a traceback names the markdown
  file and its line;
* sql blocks run as ``trajstore sql dumps/demo "<the block>"``.

A block that cannot run here is marked by an HTML comment on the line right before its fence:

* ``<!-- doc-test: skip (why) -->``: not run (a GPU, a bucket and its credentials, torchrun ranks,
  a server that runs until Ctrl-C, the skeleton of a user's own loop, another framework's dump...);
  the reason is required and should name the test that covers the same thing where there is one;
* ``<!-- doc-test: setup -->`` (a reason optional): set-up (``pip install``, a virtual environment): not run;
* ``<!-- doc-test: demo (why) -->``: the demo command (``examples/demo.py``); the session fixture runs
  README.md's once and every such block must name the same command;
* ``<!-- doc-test: exit N -->``: run, and the block must exit with status N (a ``diff`` that finds a
  difference: 1).

An unmarked block that fails, or a marker that is not one of these, fails the test naming
``file:line``; fix the document (that is the point), or mark the block with the reason.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "examples" / "README.md"]
LANGS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python", "sql": "sql"}
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
MARKER = re.compile(r"<!--\s*doc-test:\s*(?P<kind>skip|setup|demo|exit\s+(?P<code>\d+))\s*(?:\((?P<why>.+)\))?\s*-->\s*$")
TIMEOUT = 300  # seconds per block: a hung command fails instead of stalling the suite
DEMO_STEPS = 20  # what README.md says the demo leaves in dumps/demo


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str  # "bash", "python", "sql", or "" (not run)
    code: str
    mark: str | None = None  # "skip", "setup", "demo", "exit" or None
    why: str | None = None
    exit: int = 0
    bad_marker: str | None = None  # a doc-test comment that does not parse

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT)) if self.path.is_relative_to(ROOT) else self.path.name

    @property
    def where(self) -> str:
        return f"{self.name}:{self.line}"


def parse(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, with the doc-test marker on the line before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        b = Block(path, i + 1, LANGS.get(lang, ""), "\n".join(lines[i + 1:j]))
        prev = lines[i - 1].strip() if i else ""
        if "doc-test" in prev:
            mk = MARKER.match(prev)
            if mk is None:
                b.bad_marker = prev
            else:
                b.mark, b.why = mk.group("kind").split()[0], mk.group("why")
                b.exit = int(mk.group("code")) if mk.group("code") else 0
        out.append(b)
        i = j + 1
    return out


BLOCKS = [b for f in FILES for b in parse(f)]
RUN = [b for b in BLOCKS if b.lang and b.mark not in ("skip", "setup", "demo")]
NAMESPACES: dict[Path, dict] = {}  # one per markdown file: its python blocks run in order in it


def _demo_command(b: Block) -> list[str]:
    """The ``examples/demo.py`` command of a demo block: the part of its last line from the
    interpreter on (the set-up before ``&&`` is not run), the interpreter replaced by this one."""
    cmds = [c.strip() for line in b.code.splitlines() if not line.lstrip().startswith("#")
            for c in line.split("#")[0].split("&&") if "examples/demo.py" in c]
    assert len(cmds) == 1, f"{b.where}: a demo block must hold one examples/demo.py command, found {cmds}"
    argv = shlex.split(cmds[0])
    assert Path(argv[0]).name.startswith("python") and argv[1] == "examples/demo.py", f"{b.where}: {cmds[0]!r}"
    return [sys.executable, *argv[1:]]


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    """The working folder every block runs in, with ``dumps/demo`` made by README.md's demo command."""
    w = _workdir(tmp_path_factory.mktemp("docs"))
    demo = [b for b in BLOCKS if b.path.name == "README.md" and b.path.parent == ROOT and b.lang]
    assert demo and demo[0].mark == "demo", "README.md's first command block must be the demo (<!-- doc-test: demo -->)"
    argv = _demo_command(demo[0])
    p = subprocess.run([*argv, "--out", str(w / "dumps" / "demo")], cwd=w, env=_env(w), capture_output=True,
                       text=True, timeout=TIMEOUT)
    if p.returncode or "bit-identical" not in p.stdout:
        pytest.fail(f"README.md:{demo[0].line}: the demo command {shlex.join(argv[1:])} failed (exit {p.returncode})\n"
                    f"{_tail(p.stdout + p.stderr)}", pytrace=False)
    return w


def _workdir(w: Path) -> Path:
    """``w`` with ``examples`` and ``.bin/`` (python, python3, trajstore of this checkout)."""
    (w / "examples").symlink_to(ROOT / "examples")
    bin_ = w / ".bin"
    bin_.mkdir()
    py = shlex.quote(sys.executable)  # a script, not a link: a link to a venv's python loses the venv
    for name, body in (("python", f'{py} "$@"'), ("python3", f'{py} "$@"'),
                       ("trajstore", f"{py} -c 'import sys; from trajstore.cli import main; sys.exit(main())' \"$@\"")):
        (bin_ / name).write_text(f"#!/bin/sh\nexec {body}\n")
        (bin_ / name).chmod(0o755)
    return w


def _env(w: Path) -> dict:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(w / ".bin"), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _tail(text: str, n: int = 40) -> str:
    lines = text.rstrip().splitlines()
    return "\n".join((["..."] if len(lines) > n else []) + lines[-n:])


def test_markers_are_known_and_skips_say_why():
    bad = [f"{b.where}: {b.bad_marker!r}" for b in BLOCKS if b.bad_marker]
    bad += [f"{b.where}: a skip marker needs its reason in parentheses" for b in BLOCKS
            if b.mark == "skip" and not b.why]
    bad += [f"{b.where}: a marker on a block that is never run (no bash/python/sql language)" for b in BLOCKS
            if b.mark and not b.lang]
    assert not bad, "doc-test markers (see tests/test_docs.py's docstring):\n" + "\n".join(bad)


def test_readme_demo_leaves_the_dump_the_examples_run_on(work):
    import trajstore

    r = trajstore.Reader(str(work / "dumps" / "demo"))
    assert r.steps == list(range(DEMO_STEPS))
    b = r[12]
    import torch

    assert b["logprobs"].dtype == torch.bfloat16 and b["old_logprobs"].dtype == torch.float32
    for name in ("input_ids", "attention_mask", "response_mask", "rewards", "prompt", "response"):
        assert name in b, name
    # every demo block names README.md's command
    first = _demo_command(next(b for b in BLOCKS if b.mark == "demo"))
    for blk in BLOCKS:
        if blk.mark == "demo":
            assert _demo_command(blk) == first, f"{blk.where}: not README.md's demo command"


def run_block(block: Block, work: Path, namespaces: dict) -> str | None:
    """Run one block in ``work``; None, or why it failed (naming ``file:line``)."""
    hint = "fix the document, or mark the block <!-- doc-test: skip (why) --> if it cannot run here"
    if block.lang == "python":
        ns = namespaces.setdefault(block.path, {"__name__": "__doc_test__"})
        code = compile("\n" * block.line + block.code, block.name, "exec")  # tracebacks: the markdown's lines
        old = os.getcwd()
        os.chdir(work)
        try:
            exec(code, ns)  # noqa: S102 - the project's own documentation
        except Exception as e:
            tb = e.__traceback__
            while tb.tb_next is not None and tb.tb_frame.f_code.co_filename != block.name:
                tb = tb.tb_next
            line = tb.tb_lineno if tb.tb_frame.f_code.co_filename == block.name else block.line
            return (f"{block.name}:{line}: the python block of line {block.line} failed: {type(e).__name__}: {e}\n"
                    f"(python blocks of one file share one namespace, in order)\n{hint}")
        finally:
            os.chdir(old)
        return None
    if block.lang == "sql":
        argv = [str(work / ".bin" / "trajstore"), "sql", "dumps/demo", block.code]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    try:
        p = subprocess.run(argv, cwd=work, env=_env(work), capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"{block.where}: the {block.lang} block ran past {TIMEOUT} s\n--- the block\n{block.code}\n{hint}"
    if p.returncode != block.exit:
        return (f"{block.where}: the {block.lang} block exited {p.returncode}, not {block.exit}\n"
                f"--- the block\n{block.code}\n--- its output (last lines)\n{_tail(p.stdout + p.stderr)}\n{hint}")
    return None


@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_block_runs(block: Block, work):
    err = run_block(block, work, NAMESPACES)
    if err:
        pytest.fail(err, pytrace=False)


def test_the_harness_reports_file_and_line_of_a_failing_block(tmp_path):
    """The doc test can fail: a wrong command, a wrong snippet and a malformed marker are each reported
    at their markdown line; a marked exit status and a skip are honoured."""
    md = tmp_path / "x.md"
    md.write_text("# x\n\n```bash\ntrue\nfalse\n```\n\n<!-- doc-test: exit 3 -->\n```sh\nexit 3\n```\n"
                  "```python\nx = 1\n```\ntext\n```python\ny = x + 1\nz = undefined_name\n```\n"
                  "<!-- doc-test: skip (never run) -->\n```bash\nfalse\n```\n<!-- doc-test: skp -->\n```bash\ntrue\n```\n"
                  "```\nnot a command\n```\n")
    bs = parse(md)
    assert [(b.line, b.lang, b.mark) for b in bs] == [(3, "bash", None), (9, "bash", "exit"), (12, "python", None),
                                                       (16, "python", None), (21, "bash", "skip"), (25, "bash", None),
                                                       (28, "", None)]
    assert bs[5].bad_marker == "<!-- doc-test: skp -->" and bs[1].exit == 3 and bs[4].why == "never run"
    (tmp_path / "w").mkdir()
    w, ns = _workdir(tmp_path / "w"), {}
    err = run_block(bs[0], w, ns)
    assert err.startswith("x.md:3: the bash block exited 1, not 0") and "false" in err
    assert run_block(bs[1], w, ns) is None and run_block(bs[2], w, ns) is None
    err = run_block(bs[3], w, ns)  # x from the block before; the error at the snippet's own line
    assert err.startswith("x.md:18: the python block of line 16 failed: NameError") and ns[md]["y"] == 2


def test_commands_write_their_files_under_dumps():
    """What a runnable block writes in the checkout (`-o`, `--export`, a copied step file) goes under
    `dumps/` (ignored by git), so running README.md and docs/ leaves no untracked file."""
    out = re.compile(r"(?:\s-o\s+|--output\s+|--export\s+|shutil\.copy\([^,]+,\s*)[\"']?([^\s\"')]+)")
    bad = [(b.where, m.group(1)) for f in FILES for b in parse(f) if b.lang and b.mark not in ("skip", "setup")
           for m in out.finditer(b.code) if not m.group(1).startswith(("dumps/", "/tmp/", "$"))]
    assert not bad, bad
