"""A JupyterLab or Notebook 7 server for the browser tests: isolated directories, a notebook of given cells,
127.0.0.1 with a random port and token, killed on exit (`serving`, which marimo's server uses too)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_notebook(path: pathlib.Path, cells: list[str]) -> None:
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": src}
                    for src in cells],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))


@contextlib.contextmanager
def serving(argv: list, root: pathlib.Path, env: dict, ready: str, what: str):
    """Run the server `argv` in `root` (its output in root/server.log) until the URL `ready` answers (60 s at most:
    else the test fails with the log's end); terminated, or killed, on exit. Also marimo's (test_marimo.py)."""
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(argv, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(ready, timeout=2)
                break
            except Exception:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"{what} did not start: " + (root / "server.log").read_text()[-2000:])
                time.sleep(0.3)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def jupyter(root: pathlib.Path, command: str = "lab", app: str = "LabApp", extra: tuple = ()):
    """Start `jupyter <command>` serving `root`; yields (base url, token)."""
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(root / ".runtime"), "JUPYTER_CONFIG_DIR": str(root / ".config"),
           "JUPYTER_DATA_DIR": str(root / ".data"), "PYTHONPATH": str(REPO)}
    exe = pathlib.Path(sys.executable).parent / "jupyter"
    argv = [str(exe), command, "--no-browser", f"--port={port}", "--ip=127.0.0.1", f"--ServerApp.token={token}",
            f"--ServerApp.root_dir={root}", f"--{app}.expose_app_in_browser=True",
            f"--{app}.workspaces_dir={root / '.ws'}", "--ServerApp.port_retries=0",
            *(["--LabApp.extension_manager=readonly"] if command == "lab" else []), *extra,
            *(["--allow-root"] if os.geteuid() == 0 else [])]
    base = f"http://127.0.0.1:{port}"
    with serving(argv, root, env, f"{base}/api/status?token={token}", f"jupyter {command}"):
        yield base, token
