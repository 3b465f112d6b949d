#!/usr/bin/env bash
# After training: consolidate a DeepSpeed ZeRO checkpoint, check it bit for bit, push it to the Hub.
#
#   scripts/post_train.sh CKPT ORG/NAME [ckpt push options...]
#
# CKPT is a checkpoint-N/ folder, a Trainer output_dir (newest checkpoint) or a DeepSpeed save_dir.
# Options after ORG/NAME go to `ckpt push` (--public, --revision BRANCH, --create-pr, --commit-message ...).
#
# Environment:
#   HF_TOKEN      write token for the Hub (or a stored `hf auth login`); never printed
#   HF_ENDPOINT   Hub URL (default https://huggingface.co)
#   CKPT_DTYPE    fp32 (default), bf16 or fp16
#   CKPT_OUT      where to write the consolidated folder (default: a temporary folder, removed at exit)
#
# stdout: the JSON object of `ckpt push` only; everything else goes to stderr.
# Exit codes: 0 pushed; 1 bad checkpoint or failed verification (nothing sent);
#             2 usage error or HF_HUB_OFFLINE set; 3 Hub, auth or network failure: re-run to
#             retry (files that already arrived are not sent again).
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 CKPT ORG/NAME [ckpt push options...]" >&2
    exit 2
fi
ckpt_path=$1
repo=$2
shift 2

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if command -v ckpt >/dev/null 2>&1; then
    ckpt=(ckpt)
elif [[ -x "$here/../.venv/bin/ckpt" ]]; then
    ckpt=("$here/../.venv/bin/ckpt")
else
    echo "error: no \`ckpt\` on PATH or in .venv/bin; pip install ckpttools" >&2
    exit 2
fi

out=${CKPT_OUT:-}
if [[ -z "$out" ]]; then
    work=$(mktemp -d "${TMPDIR:-/tmp}/post-train.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    out="$work/model"
fi

echo "== consolidate $ckpt_path -> $out" >&2
"${ckpt[@]}" consolidate "$ckpt_path" --out "$out" --dtype "${CKPT_DTYPE:-fp32}" --overwrite >&2
echo "== verify $out against $ckpt_path" >&2
"${ckpt[@]}" verify "$out" --against "$ckpt_path" >&2
echo "== push $out -> $repo" >&2
"${ckpt[@]}" push "$out" --repo "$repo" --source "$ckpt_path" --json "$@"
