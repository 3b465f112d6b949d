#!/usr/bin/env bash
# After training: consolidate a DeepSpeed checkpoint, check it bit for bit, push it to the Hugging Face Hub.
# Copy this file into your training repository; it needs `ckpt` and `python3` (CKPT_PYTHON) from one environment:
#
#   pip install torch --index-url https://download.pytorch.org/whl/cpu   # CPU torch, before ckpttools
#   pip install "ckpttools[hub]"
#
#   post-train.sh CKPT ORG/NAME [ckpt push options: --revision BRANCH, --public, --create-pr, ...]
#
# CKPT is a checkpoint-N/ folder, a Trainer output_dir (its newest checkpoint) or a DeepSpeed save_dir.
#
# Environment:
#   HF_TOKEN            write token for the Hub (or a stored `hf auth login`); never printed
#   HF_ENDPOINT         Hub URL (default https://huggingface.co)
#   CKPT_DTYPE          fp32 (default), bf16 or fp16
#   CKPT_WORK           where consolidated models are kept between runs (default ~/.cache/ckpttools/post-train)
#   CKPT_PUSH_ATTEMPTS  tries of the push when the Hub or the network fails (exit 3); default 4
#   CKPT_RETRY_DELAY    seconds before the first retry, doubled after each; default 30
#
# A re-run after a failure converts nothing again: the model is kept in $CKPT_WORK/<key>/model, the key naming
# the checkpoint (resolved folder, tag, a fingerprint of its files) and the dtype, and the bit-for-bit check is
# recorded beside it. The push resumes: files already on the Hub are not sent again.
#
# stdout: the JSON object of `ckpt push` only; everything else goes to stderr.
# Exit codes (those of ckpt): 0 pushed; 1 bad checkpoint or failed verification (nothing sent); 2 usage error;
# 3 the Hub or the network still failing after the last attempt (re-run later); 4 authentication: no token, a
# rejected or read-only token (fix the token; not retried).
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 CKPT ORG/NAME [ckpt push options...]" >&2
    exit 2
fi
checkpoint=$1
repo=$2
shift 2
dtype=${CKPT_DTYPE:-fp32}
attempts=${CKPT_PUSH_ATTEMPTS:-4}
delay=${CKPT_RETRY_DELAY:-30}
python=${CKPT_PYTHON:-python3}

if ! command -v ckpt >/dev/null 2>&1; then
    echo "error: no \`ckpt\` on PATH; pip install \"ckpttools[hub]\"" >&2
    exit 2
fi

# 1. Cheap checks first: a token that the Hub accepts and that may write, before any conversion.
"$python" - <<'PY'
import sys

from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled


def fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


try:
    info = HfApi().whoami()
except OfflineModeIsEnabled:
    fail("HF_HUB_OFFLINE is set, so nothing can be pushed; unset it", 2)
except LocalTokenNotFoundError:
    fail("no Hub token: set HF_TOKEN (a write token) or run `hf auth login`", 4)
except HfHubHTTPError as e:
    if e.response.status_code in (401, 403):
        fail(f"the Hub rejected the token (HTTP {e.response.status_code}); set a valid HF_TOKEN", 4)
    fail(f"the Hub failed (HTTP {e.response.status_code}); retry later", 3)
except Exception as e:  # connection refused, DNS, timeout: worth a retry later
    fail(f"cannot reach the Hub ({type(e).__name__}: {e}); retry later", 3)
if ((info.get("auth") or {}).get("accessToken") or {}).get("role") == "read":
    fail("the token is read-only; pushing needs a write token", 4)
print(f"== the Hub accepts the token of {info.get('name')}", file=sys.stderr)
PY

# 2. Which checkpoint, exactly: resolve it once, so every step reads the same one, and key the work folder by it.
inspected=$(ckpt inspect "$checkpoint" --json)
info=$("$python" -c '
import hashlib, json, os, sys
info, dtype = json.load(sys.stdin), sys.argv[1]
src, tag = os.path.realpath(info["path"]), info["tag"]
h = hashlib.sha256(f"{src}\0{tag}\0{dtype}".encode())
tag_dir = os.path.join(src, tag)
files = [os.path.join(src, n) for n in sorted(os.listdir(src)) if os.path.isfile(os.path.join(src, n))]
for root, dirs, names in os.walk(tag_dir):
    dirs.sort()
    files += [os.path.join(root, n) for n in sorted(names)]
for path in files:  # a checkpoint written again under the same name gets a new key
    st = os.stat(path)
    h.update(f"{os.path.relpath(path, src)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
print(src, tag, f"{os.path.basename(src)}-{tag}-{dtype}-{h.hexdigest()[:12]}", sep="\n")
' "$dtype" <<<"$inspected")
{ read -r src; read -r tag; read -r key; } <<<"$info"
work=${CKPT_WORK:-$HOME/.cache/ckpttools/post-train}/$key
model=$work/model
mkdir -p "$work"

# 3. Consolidate, unless an earlier run did: ckpt publishes a folder only complete (staged, then renamed), and
#    its manifest is written last, so a folder holding one is a finished conversion.
if [[ -f "$model/.ckpt-manifest.json" ]]; then
    echo "== $model: consolidated by an earlier run; not converting again" >&2
else
    echo "== consolidate $src ($tag) -> $model" >&2
    ckpt consolidate "$src" --tag "$tag" --out "$model" --dtype "$dtype" >&2
fi

# 4. Verify every tensor bit for bit against the shards, once per model (push checks the folder again anyway).
if [[ -f "$work/verified" ]]; then
    echo "== verified bit for bit by an earlier run" >&2
else
    echo "== verify $model against $src" >&2
    rc=0
    ckpt verify "$model" --against "$src" --tag "$tag" >&2 || rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "== verification failed (exit $rc); if the model is at fault, delete $work to convert again" >&2
        exit "$rc"
    fi
    touch "$work/verified"
fi

# 5. Push; only exit 3 (the Hub or the network failed) is retried. A retry resumes the upload.
attempt=1
while :; do
    rc=0
    ckpt push "$model" --repo "$repo" --source "$src" --json "$@" >"$work/push.json" || rc=$?
    if [[ $rc -eq 0 ]]; then
        break
    fi
    if [[ $rc -ne 3 ]]; then
        echo "== push failed with exit $rc: not retried (retrying cannot fix it)" >&2
        exit "$rc"
    fi
    if [[ $attempt -ge $attempts ]]; then
        echo "== the Hub still fails after $attempt attempts; re-run later to resume the upload" >&2
        exit 3
    fi
    echo "== the Hub or the network failed (attempt $attempt of $attempts); retrying in ${delay}s" >&2
    sleep "$delay"
    delay=$((delay * 2))
    attempt=$((attempt + 1))
done
cat "$work/push.json"
