#!/usr/bin/env bash
# Runs every check: ruff, the front-end's unit tests (vitest), then pytest (Python, notebooks, real browser).
# Either runner fails when it collects no test.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
npx vitest run
.venv/bin/python -m pytest "$@"
