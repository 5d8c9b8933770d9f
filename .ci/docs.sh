#!/usr/bin/env bash
# Build the documentation site strictly: a broken link, a missing anchor or a docstring the API
# reference cannot render fails the build. Needs the docs extra: pip install -e '.[docs]'.
set -euo pipefail
cd "$(dirname "$0")/.."

site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site"
