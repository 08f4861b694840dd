"""``_provision.ensure_apt`` from two test processes at once (the suite runs on two, ``pytest -n 2``): one
installs while the other waits, and both see the packages installed. A fake ``dpkg`` / ``apt-get`` on PATH
stands for Debian's: its ``apt-get install`` fails, as the real one does, when another holds the dpkg lock."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a POSIX lock file and shell scripts")
def test_two_processes_install_one_at_a_time(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    (bin_ / "dpkg").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        test -e {state}/installed-"$2"
        """))
    (bin_ / "apt-get").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1" = update ] && exit 0
        mkdir {state}/dpkg-lock 2>/dev/null || {{ echo "E: Could not get lock" >&2; exit 100; }}
        echo x >> {state}/runs
        sleep 1
        for p in "$@"; do touch {state}/installed-"$p"; done
        rmdir {state}/dpkg-lock
        """))
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); os.geteuid = lambda: 0\n"
            "import _provision; print(_provision.ensure_apt('fake-package'))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(HERE)], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert outs == ["None", "None"]  # neither found dpkg locked: the second waited, then found it installed
    assert (state / "installed-fake-package").exists()
    assert (state / "runs").read_text().count("x") == 1  # installed once
