#!/usr/bin/env bash
# This checkout's post-training recipe: examples/post-train.sh (the file to copy into a training repository; its
# header documents the arguments, environment and exit codes), run with ./.venv when no `ckpt` is on PATH, and
# with a temporary work folder, removed at exit, unless CKPT_WORK names one to keep between runs.
#
#   scripts/post_train.sh CKPT ORG/NAME [ckpt push options...]
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! command -v ckpt >/dev/null 2>&1 && [[ -x "$here/../.venv/bin/ckpt" ]]; then
    PATH="$here/../.venv/bin:$PATH"
fi
if [[ -z "${CKPT_WORK:-}" ]]; then
    CKPT_WORK=$(mktemp -d "${TMPDIR:-/tmp}/post-train.XXXXXX")
    trap 'rm -rf "$CKPT_WORK"' EXIT
fi
export CKPT_WORK PATH
bash "$here/../examples/post-train.sh" "$@"
