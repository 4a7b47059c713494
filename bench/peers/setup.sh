#!/usr/bin/env bash
# Creates bench/.venv-peers (if missing) and installs the pinned peer frameworks of
# requirements.txt into it. Idempotent: a venv already holding exactly these pins is left
# alone (no network). Prints the venv's python path on stdout; pip's output goes to stderr.
# Everything is fetched here, never at bench run time.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$(dirname "$here")/.venv-peers"
req="$here/requirements.txt"
python="${PYTHON:-python3}"

if [[ ! -x "$venv/bin/python" ]]; then
    echo "setup.sh: creating $venv with $("$python" --version 2>&1)" >&2
    "$python" -m venv "$venv"
fi

stamp="$venv/.requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    echo "setup.sh: installing $req" >&2
    "$venv/bin/python" -m pip install --disable-pip-version-check -q -r "$req" >&2
    "$venv/bin/python" -m pip check >&2
    echo "$want" > "$stamp"
else
    echo "setup.sh: $venv is up to date" >&2
fi

echo "$venv/bin/python"
