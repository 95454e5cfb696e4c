"""predmask.progress in a real subprocess: plain lines to stderr and the logger unless stdout and stderr are both
terminals (then a bar), a heartbeat while nothing advances, the interval from the environment."""

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
    log_file = sys.argv[5] if len(sys.argv) > 5 else None
    with progress("pretraining", None if total == "none" else int(total), log=logging.getLogger("job"),
                  unit="steps", completed=start, interval_s=interval, log_file=log_file) as bar:
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


def _on_terminal(tmp_path: Path, *, stdout_too: bool, log_file: Path | None = None) -> tuple[str, bytes]:
    """Run the script with stderr on a pseudo-terminal (stdout too, or a pipe); (the screen, what the pipe got)."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, str(script), "0", "5", "0", "ok", *([str(log_file)] if log_file else [])],
                            stdout=slave if stdout_too else subprocess.PIPE, stderr=slave, env=env)
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
    return screen.decode(errors="replace"), stdout or b""


def test_on_a_terminal_it_draws_a_bar_and_writes_no_plain_lines(tmp_path: Path) -> None:
    log_file = tmp_path / "logs" / "study.log"
    text, _ = _on_terminal(tmp_path, stdout_too=True, log_file=log_file)
    assert "pretraining" in text and "5/5" in text and "loss 0.4" in text
    assert not re.search(r"pretraining: \d/5 steps", text)
    assert "LOG" not in text  # the logger gets no lines while a bar is shown
    # the log file gets the plain lines a piped run writes (interval 0: each advance, and the final line)
    lines = log_file.read_text().splitlines()
    assert [re.match(r"pretraining: (\d)/5 steps", ln).group(1) for ln in lines] == ["1", "2", "3", "4", "5", "5"]


def test_a_log_file_gets_the_same_plain_lines(tmp_path: Path) -> None:
    log_file = tmp_path / "study.log"
    code, err, _ = _run(tmp_path, "0", "5", "0", "ok", str(log_file))
    assert code == 0 and len(err) == 6
    assert log_file.read_text().splitlines() == err


def test_with_stdout_piped_it_writes_plain_lines_even_beside_a_terminal(tmp_path: Path) -> None:
    """`cmd | tee log`: stderr stays on the terminal, stdout is a pipe; no bar, the plain lines."""
    text, stdout = _on_terminal(tmp_path, stdout_too=False)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    assert [ln for ln in lines if re.fullmatch(r"pretraining: \d/5 steps \(\d+%\) loss \S+ \[elapsed .*\]", ln)] == lines
    assert len(lines) == 6  # interval 0: one per advance, and the final line
    assert stdout.decode().splitlines() == [f"LOG {ln}" for ln in lines]


HEARTBEAT = textwrap.dedent("""
    import logging, sys, threading
    from predmask.progress import progress

    written = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            print("LOG", record.getMessage(), flush=True)
            written.set()

    log = logging.getLogger("job")
    log.addHandler(Seen())
    log.setLevel(logging.INFO)
    with progress("one long seed", 2, log=log, unit="seeds", interval_s=float(sys.argv[1])) as bar:
        bar.working(0.5, status="seed 0 half done")
        assert written.wait(120), "no heartbeat line"  # the main thread does nothing but wait: no advance
        written.clear()
        bar.advance(1, status="seed 0 done")
        bar.working(0.25)
        assert written.wait(120), "no heartbeat line after the advance"
""")


def test_a_heartbeat_writes_lines_while_nothing_advances(tmp_path: Path) -> None:
    """The work inside the block never calls advance while it waits: only the heartbeat can write the lines it
    waits for (a missing heartbeat hangs the script until the subprocess timeout fails the test)."""
    script = tmp_path / "beat.py"
    script.write_text(HEARTBEAT)
    done = subprocess.run([sys.executable, str(script), "0.05"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    err = done.stderr.splitlines()
    assert len(err) >= 3 and done.stdout.splitlines() == [f"LOG {ln}" for ln in err]
    assert re.fullmatch(r"one long seed: 0/2 seeds \(0%\) seed 0 half done \[elapsed \d+s, eta \d+s\]", err[0])
    assert re.fullmatch(r"one long seed: 1/2 seeds \(50%\) seed 0 .*done \[elapsed \d+s, eta \d+s\]", err[-2])
    assert re.fullmatch(r"one long seed: 1/2 seeds \(50%\) seed 0 done \[elapsed \d+s, eta \d+s\]", err[-1])


def test_the_interval_comes_from_the_environment_when_not_given(tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    script.write_text("from predmask.progress import progress\n"
                      "with progress('steps', 3, unit='steps') as bar:\n"
                      "    for _ in range(3):\n"
                      "        bar.advance()\n")
    def run(value: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                              check=False, env={**os.environ, "PREDMASK_PROGRESS_INTERVAL_S": value})

    every = run("0")
    assert every.returncode == 0 and len(every.stderr.splitlines()) == 4  # each advance and the final line
    assert len(run("1e9").stderr.splitlines()) == 1
    bad = run("soon")
    assert bad.returncode == 1
    assert bad.stderr.splitlines()[-1] == ("ValueError: $PREDMASK_PROGRESS_INTERVAL_S='soon' is not a number of "
                                           "seconds; allowed: a finite number >= 0")


def test_advance_to_moves_up_to_a_polled_total_and_never_back(capsys) -> None:  # type: ignore[no-untyped-def]
    from predmask.progress import progress

    with progress("seeds", 10, unit="seeds", bar=False, interval_s=0) as bar:
        for polled in (0, 3, 3, 2, 7):
            bar.advance_to(polled, status=f"poll {polled}")
        assert bar.completed == 7
    counts = [re.match(r"seeds: (\d+)/10 seeds \(\d+%\) poll (\d)", ln) for ln in capsys.readouterr().err.splitlines()]
    assert all(counts)
    assert [(m.group(1), m.group(2)) for m in counts] == [("3", "3"), ("7", "7"), ("7", "7")]  # + the final line
