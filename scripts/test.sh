#!/usr/bin/env bash
# Runs every check: ruff, the import-linter contract, the front-end's unit tests (vitest), the docs site
# (scripts/build_docs.py), then pytest (Python, notebooks, real browser).
# Either runner fails when it collects no test.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/lint-imports --no-cache >/dev/null || .venv/bin/lint-imports --no-cache  # the house's floors (pyproject.toml)
npx vitest run
.venv/bin/python scripts/build_docs.py  # mkdocs build --strict, offline: no asset from another host
.venv/bin/python -m pytest "$@"
