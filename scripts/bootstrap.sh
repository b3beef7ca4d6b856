# Sourced by the launchers: make sure .venv exists and holds this checkout's
# package with the extras named in $1 ("" for none, e.g. "test" or "all").
# Every caller passes $1 explicitly: a script sourced without arguments sees
# its caller's own arguments as $1 (`scripts/worker --config x` would ask pip
# for the extra "--config"). Re-installs only when pyproject.toml changed
# since the last install. The test extras hold every runtime extra, so a
# .venv installed for the tests serves the other launchers as it is.
if [ "$#" -ne 1 ]; then
  echo "scripts/bootstrap.sh: source it with exactly one argument, the extras (\"\" for none)" >&2
  exit 2
fi
extras="$1"
case "$extras" in
  *[!a-z,]*) echo "scripts/bootstrap.sh: extras must be names like 'test' or 'http,web', got '$extras'" >&2; exit 2 ;;
esac
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv" >&2
  "$python" -m venv .venv
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
fi
stamp=".venv/.trio_dispatch-installed-${extras:-base}"
current() { [ -f "$1" ] && [ ! pyproject.toml -nt "$1" ]; }
if ! current "$stamp" && ! current ".venv/.trio_dispatch-installed-test"; then
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
