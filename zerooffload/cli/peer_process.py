"""A benchmark peer (DeepSpeed) in a long-lived child process of its own venv, one JSON line per request.

The child prints one JSON object per line: first ``{"ready": ...}`` or ``{"error": ...}``, then one
answer per request line it reads. DeepSpeed prints lines of its own on stdout, which are skipped. The
child runs outside the repository, so that its ``import`` finds its venv's packages, not ours.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile

__all__ = ["PeerProcess", "PeerError"]


class PeerError(RuntimeError):
    """The peer refused to start, answered with an error, or exited."""


class PeerProcess:
    """Starts ``command`` (DeepSpeed on the CPU) and waits for its first line; ``ask`` sends a request."""

    def __init__(self, command: list[str]):
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "DS_ACCELERATOR": "cpu"}, cwd=tempfile.gettempdir())
        ready = self._reply()
        if "error" in ready:
            self.close()
            raise PeerError(ready["error"])

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise PeerError(f"the helper process exited with status {self.proc.wait()}")

    def ask(self, request: str) -> dict:
        """Send one request line; its answer (raises ``PeerError`` on an ``error`` answer)."""
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        answer = self._reply()
        if "error" in answer:
            raise PeerError(answer["error"])
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
