"""Refresh the README's screenshots in docs/img: runs the browser tests that take them, writing into docs/img.

    .venv/bin/python tests/browser/update_docs_img.py

(The tests themselves write screenshots under tests/artifacts/screenshots, an ignored path.)"""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ["tests/browser/test_standalone.py::test_click_layer_shows_shapes_and_max_diff",
         "tests/browser/test_live_widget.py::test_toggle_grad_zero_live",
         "tests/browser/test_readability.py::test_vision_shaped_default_view_is_readable",
         "tests/browser/test_snapshot.py::test_restart_and_reopen_show_a_snapshot_not_model_not_found",
         "tests/browser/test_watch_live.py::test_standalone_page_of_a_diverging_run"]

if __name__ == "__main__":
    env = {**os.environ, "HW_UPDATE_DOCS_IMG": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
    sys.exit(subprocess.call(cmd, cwd=ROOT, env=env))
