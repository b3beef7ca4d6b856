# Sourced by the launchers: make sure .venv exists and holds this checkout's
# package with the extras named in $1 (e.g. "test"). Re-installs only when
# pyproject.toml changed since the last install.
extras="${1:-}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv" >&2
  "$python" -m venv .venv
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
fi
stamp=".venv/.trio_dispatch-installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "== installing trio_dispatch${extras:+[$extras]} into .venv" >&2
  spec="."
  [ -n "$extras" ] && spec=".[$extras]"
  if ! .venv/bin/python -m pip install --disable-pip-version-check -e "$spec" \
      > .venv/install.log 2>&1; then
    cat .venv/install.log >&2
    echo "installing failed; the log above is also in .venv/install.log" >&2
    exit 1
  fi
  touch "$stamp"
fi
