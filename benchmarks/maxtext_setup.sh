#!/usr/bin/env bash
# Create MaxText's own virtualenv for benchmarks/train_step.py (MaxText runs there, in a
# subprocess; zoo's environment is never touched).
#
#   bash benchmarks/maxtext_setup.sh [VENV_DIR]      # default: benchmarks/.venv-maxtext
#   MAXTEXT_PLATFORM=gpu bash benchmarks/maxtext_setup.sh   # also jax[cuda12] on top
#
# MaxText (PyPI `maxtext`) needs Python >= 3.12: the interpreter is `$PYTHON312`, else
# `python3.12` on PATH, else pyenv's 3.12, else Debian's python3.12 via apt (not in bookworm).
# Its dependencies are the wheel's own decoupled requirements (DECOUPLE_GCLOUD=TRUE: no Google
# Cloud clients), minus the NVIDIA wheels on CPU. The versions are pinned by
# benchmarks/maxtext-requirements.lock when present (written by the first successful setup).
# Exit 0 and the venv's python on the last line of stdout, or exit 1 and the reason.
set -euo pipefail

MAXTEXT_VERSION="${MAXTEXT_VERSION:-0.2.5}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${1:-$HERE/.venv-maxtext}"
LOCK="$HERE/maxtext-requirements.lock"
PLATFORM="${MAXTEXT_PLATFORM:-cpu}"

fail() { echo "maxtext_setup: $*" >&2; exit 1; }

is312() { [ -n "$1" ] && "$1" -c 'import sys, venv; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; }

find_python312() {
  local c
  for c in "${PYTHON312:-}" "$(command -v python3.12 || true)"; do
    is312 "$c" && { echo "$c"; return 0; }
  done
  if command -v pyenv >/dev/null 2>&1; then
    c="$(pyenv root)/versions/$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -1)/bin/python3.12"
    is312 "$c" && { echo "$c"; return 0; }
  fi
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
      && apt-cache policy python3.12 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    apt-get install -y -q python3.12 python3.12-venv >&2 && is312 /usr/bin/python3.12 && { echo /usr/bin/python3.12; return 0; }
  fi
  return 1
}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import maxtext, jax" 2>/dev/null; then
  echo "maxtext_setup: $VENV already set up" >&2
  echo "$VENV/bin/python"
  exit 0
fi

PY="$(find_python312)" || fail "no Python 3.12 interpreter (not on PATH, not in pyenv; apt has no python3.12 candidate)"
"$PY" -m venv "$VENV" || fail "could not create a virtualenv with $PY"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -U pip >&2 || fail "pip upgrade failed (no package index reachable?)"

if [ -f "$LOCK" ]; then
  "${PIP[@]}" install -r "$LOCK" >&2 || fail "pip install -r $LOCK failed"
else
  TMP="$(mktemp -d)"
  "${PIP[@]}" download --no-deps -d "$TMP" "maxtext==$MAXTEXT_VERSION" >&2 || fail "maxtext==$MAXTEXT_VERSION not on the package index"
  "$VENV/bin/python" - "$TMP"/maxtext-*.whl "$TMP/req.txt" <<'PYEOF'
import re, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
name = "dependencies/requirements/generated_requirements/decoupled-requirements.txt"
lines = zipfile.ZipFile(whl).read(name).decode().splitlines()
keep = [l for l in lines if l.strip() and not l.startswith("#") and not re.match(r"(nvidia-|cuda-|pynvml|apache-tvm-ffi)", l)]
open(out, "w").write("\n".join(keep) + "\n")
PYEOF
  "${PIP[@]}" install "$TMP"/maxtext-*.whl -r "$TMP/req.txt" >&2 || fail "installing MaxText's decoupled requirements failed"
  "${PIP[@]}" freeze --exclude-editable | sed "s|^maxtext @ .*|maxtext==$MAXTEXT_VERSION|" > "$LOCK"
  echo "maxtext_setup: wrote $LOCK" >&2
fi
if [ "$PLATFORM" = gpu ]; then
  JAXV="$("$VENV/bin/python" -c 'import jax; print(jax.__version__)')"
  "${PIP[@]}" install "jax[cuda12]==$JAXV" >&2 || fail "jax[cuda12]==$JAXV failed"
fi
"$VENV/bin/python" -c "import maxtext, jax; print('maxtext_setup: maxtext', getattr(maxtext, '__version__', '?'), 'jax', jax.__version__)" >&2 \
  || fail "maxtext does not import in $VENV"
echo "$VENV/bin/python"
