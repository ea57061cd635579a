#!/bin/sh
# The Debian packages only the tests use (promtool, redis-server, the staging fleet's daemons).
#   apt-packages.sh install PKG...   make setup: as root, install what is missing; as anyone else,
#                                    print the one apt command to run and go on (make demo works)
#   apt-packages.sh require PKG...   make test: exit 1 naming that command while one is missing
mode=$1
shift
missing=""
for p in "$@"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
cmd="sudo apt-get install -y --no-install-recommends$missing"
if [ "$mode" = install ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "apt: installing$missing"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null && exit 0
  fi
  echo "make setup: the tests need Debian packages that are missing (make demo does not): $cmd"
  exit 0
fi
echo "make test: missing Debian packages; run: $cmd" >&2
exit 1
