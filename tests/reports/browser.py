"""Open a page in a real headless Chromium and report what a reader would meet: console errors, failed images.

Chromium is driven over the DevTools protocol on ``--remote-debugging-pipe`` (file descriptors 3 and 4, messages
as NUL-terminated JSON), with the standard library only: create a tab, navigate, wait for the load event, then
read every <img>'s naturalWidth and the page's size in the page itself.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NAMES: tuple[str, ...] = ("chromium", "chromium-browser")
TIMEOUT_S = 45.0


def find_chromium() -> str | None:
    """The distribution's Chromium on PATH (None when it is not installed)."""
    return next((path for name in NAMES if (path := shutil.which(name))), None)


@dataclass
class PageReport:
    """What the browser saw: errors from the console, the log and uncaught exceptions, each image, page facts."""

    errors: list[str] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)  # src, complete, naturalWidth
    facts: dict[str, Any] = field(default_factory=dict)


PAGE_FACTS = """JSON.stringify({
  images: [...document.images].map(i => ({src: i.getAttribute('src'), complete: i.complete,
                                          naturalWidth: i.naturalWidth})),
  title: document.title,
  height: document.documentElement.scrollHeight,
  sections: [...document.querySelectorAll('section')].map(s => s.id),
  open: [...document.querySelectorAll('section > details[open]')].map(d => d.parentElement.id),
  text: document.body.innerText
})"""


class _Pipe:
    """One DevTools connection: numbered commands, their replies, and the events that arrive meanwhile."""

    def __init__(self, write_fd: int, read_fd: int, proc: subprocess.Popen) -> None:
        self.write_fd, self.read_fd, self.proc = write_fd, read_fd, proc
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from Chromium over the DevTools pipe")
            ready, _, _ = select.select([self.read_fd], [], [], left)
            if ready:
                chunk = os.read(self.read_fd, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the DevTools pipe (exit {self.proc.poll()})")
                self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self._read_message(deadline))


def _errors(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        p = e.get("params", {})
        if e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
        elif e.get("method") == "Runtime.exceptionThrown":
            out.append("exception: " + p["exceptionDetails"].get("text", ""))
        elif e.get("method") == "Log.entryAdded" and p["entry"].get("level") == "error":
            out.append(f"log: {p['entry'].get('text', '')} {p['entry'].get('url', '')}".strip())
    return out


def open_page(page: Path, chromium: str) -> PageReport:
    """Load ``page`` (a local file) in headless Chromium until its load event; what it saw."""
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()

    def wire() -> None:  # in the child: the protocol's fds 3 (commands in) and 4 (messages out)
        commands, messages = (fcntl.fcntl(fd, fcntl.F_DUPFD, 5) for fd in (to_browser_r, from_browser_w))
        os.dup2(commands, 3)
        os.dup2(messages, 4)

    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        proc = subprocess.Popen(
            [
                chromium,
                "--headless=new",
                "--disable-gpu",
                "--no-sandbox",
                "--no-first-run",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                "--window-size=1400,1000",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=wire,  # noqa: PLW1509 (wire only duplicates fds: no lock a thread could hold)
            pass_fds=(3, 4),
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        pipe = _Pipe(to_browser_w, from_browser_r, proc)
        try:
            target = pipe.call("Target.createTarget", url="about:blank")["targetId"]
            session = pipe.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            for domain in ("Runtime", "Log", "Page"):
                pipe.call(f"{domain}.enable", session)
            pipe.call("Page.navigate", session, url=page.resolve().as_uri())
            pipe.wait_for("Page.loadEventFired")
            facts = pipe.call("Runtime.evaluate", session, expression=PAGE_FACTS, returnByValue=True)
            values = json.loads(facts["result"]["value"])
            report = PageReport(errors=_errors(pipe.events), images=values.pop("images"), facts=values)
            try:
                pipe.call("Browser.close")
            except RuntimeError:
                pass  # the browser may close the pipe before it answers
            return report
        finally:
            os.close(to_browser_w)
            os.close(from_browser_r)
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
