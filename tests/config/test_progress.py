"""predmask.progress in a real subprocess: plain lines to stderr and the logger without a terminal, a bar on one."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import logging, sys
    from predmask.progress import progress

    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="LOG %(message)s")
    interval, total, start, fail = float(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "fail"
    with progress("pretraining", None if total == "none" else int(total), log=logging.getLogger("job"),
                  unit="steps", completed=start, interval_s=interval) as bar:
        for i in range(start, 5):
            bar.advance(status=f"loss {i / 10:.1f}")
            if fail and i == 2:
                raise RuntimeError("stopped")
""")


def _run(tmp_path: Path, *args: str) -> tuple[int, list[str], list[str]]:
    """Run the script with stdout and stderr redirected to files; (exit code, stderr lines, stdout lines)."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as o, err.open("w") as e:
        code = subprocess.run([sys.executable, str(script), *args], stdout=o, stderr=e, check=False).returncode
    return code, err.read_text().splitlines(), out.read_text().splitlines()


def test_without_a_terminal_every_due_line_goes_to_stderr_and_the_logger(tmp_path: Path) -> None:
    code, err, out = _run(tmp_path, "0", "5", "0", "ok")
    assert code == 0
    # interval 0: a line at every advance, then the final line
    counts = [re.match(r"pretraining: (\d)/5 steps \((\d+)%\) loss (\S+) \[elapsed \d+s(, eta \d+s)?\]$", ln)
              for ln in err]
    assert all(counts), err
    assert [(m.group(1), m.group(2), m.group(3)) for m in counts] == [
        ("1", "20", "0.0"), ("2", "40", "0.1"), ("3", "60", "0.2"), ("4", "80", "0.3"), ("5", "100", "0.4"),
        ("5", "100", "0.4")]
    assert out == [f"LOG {ln}" for ln in err]
    assert "eta" not in err[-1]


def test_a_long_interval_leaves_only_the_final_line(tmp_path: Path) -> None:
    code, err, out = _run(tmp_path, "1e9", "5", "2", "ok")
    assert code == 0
    assert len(err) == 1 and re.fullmatch(r"pretraining: 5/5 steps \(100%\) loss 0\.4 \[elapsed \d+s\]", err[0])
    assert out == [f"LOG {err[0]}"]


def test_unknown_totals_count_and_a_failure_still_writes_the_last_state(tmp_path: Path) -> None:
    code, err, _ = _run(tmp_path, "1e9", "none", "0", "fail")
    assert code == 1
    assert err[0] == err[0].strip() and re.fullmatch(r"pretraining: 3 steps loss 0\.2 \[elapsed \d+s\]", err[0])
    assert "RuntimeError: stopped" in err[-1]


def test_on_a_terminal_it_draws_a_bar_and_writes_no_plain_lines(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, str(script), "0", "5", "0", "ok"], stdout=subprocess.PIPE,
                            stderr=slave, env=env)
    os.close(slave)
    screen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    os.close(master)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    text = screen.decode(errors="replace")
    assert "pretraining" in text and "5/5" in text and "loss 0.4" in text
    assert not re.search(r"pretraining: \d/5 steps", text)
    assert stdout == b""  # the logger gets no lines while a bar is shown


def test_advance_to_moves_up_to_a_polled_total_and_never_back(capsys) -> None:  # type: ignore[no-untyped-def]
    from predmask.progress import progress

    with progress("seeds", 10, unit="seeds", bar=False, interval_s=0) as bar:
        for polled in (0, 3, 3, 2, 7):
            bar.advance_to(polled, status=f"poll {polled}")
        assert bar.completed == 7
    counts = [re.match(r"seeds: (\d+)/10 seeds \(\d+%\) poll (\d)", ln) for ln in capsys.readouterr().err.splitlines()]
    assert all(counts)
    assert [(m.group(1), m.group(2)) for m in counts] == [("3", "3"), ("7", "7"), ("7", "7")]  # + the final line
