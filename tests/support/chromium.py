"""Headless Chromium (Debian's ``chromium``) driven over the DevTools protocol: open a page
and evaluate JavaScript in it as often as needed, while the page keeps running — as a page
a person keeps open does, never reloaded by the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from itertools import count
from pathlib import Path
from typing import Any

import websocket

CHROMIUM = "/usr/bin/chromium"
START_TIMEOUT_S = 30.0


class BrowserError(Exception):
    """Chromium did not start, or a DevTools call failed."""


class Chromium:
    """One headless Chromium with its own profile in ``profile_dir``, in a process group of
    its own: :meth:`close` ends that group (the browser and every helper process it
    started) and nothing else."""

    def __init__(self, profile_dir: Path, binary: str = CHROMIUM) -> None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        self.log = profile_dir / "chromium.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    "--headless",
                    "--no-sandbox",  # tests run as root, where the sandbox refuses to start
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--no-default-browser-check",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    "--disable-extensions",
                    "--no-proxy-server",
                    f"--user-data-dir={profile_dir}",
                    "--remote-debugging-address=127.0.0.1",
                    "--remote-debugging-port=0",  # the port it took is written to a file
                    "about:blank",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self.port = self._wait_for_port(profile_dir / "DevToolsActivePort")
        except BaseException:
            self.close()
            raise

    def _wait_for_port(self, active_port: Path) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise BrowserError(f"chromium exited with {code}: {self._tail()}")
            try:
                return int(active_port.read_text().split()[0])
            except (OSError, ValueError, IndexError):  # not written (completely) yet
                time.sleep(0.1)
        raise BrowserError(f"chromium did not open its DevTools port: {self._tail()}")

    def _tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def open(self, url: str) -> Page:
        """The browser's tab, navigated to ``url`` and loaded."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=10) as r:
            targets = json.loads(r.read())
        tab = next(t for t in targets if t["type"] == "page")
        page = Page(tab["webSocketDebuggerUrl"])
        page.navigate(url)
        return page

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # the browser, which ends its helpers and reaps them
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        try:  # helpers still alive in the group (the group outlives its leader)
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Page:
    """One tab, over its DevTools WebSocket."""

    def __init__(self, ws_url: str) -> None:
        # no Origin header: Chromium refuses DevTools connections from web origins
        self._socket = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self._ids = count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        self._socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv())
            if message.get("id") != call_id:
                continue  # an event, or the answer to an earlier call
            if "error" in message:
                raise BrowserError(f"{method}: {message['error']}")
            result: dict[str, Any] = message["result"]
            return result

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def navigate(self, url: str, timeout: float = 30.0) -> None:
        navigated = self.call("Page.navigate", url=url)
        if navigated.get("errorText"):
            raise BrowserError(f"{url}: {navigated['errorText']}")
        deadline = time.monotonic() + timeout
        while self.evaluate("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise BrowserError(f"{url} did not finish loading")
            time.sleep(0.05)

    def close(self) -> None:
        self._socket.close()
