#!/usr/bin/env bash
# What the loopback deployment (infra/stack.py) needs beyond `make setup`: PostgreSQL and OpenSSH's server
# from the system's packages, and the `deploy` extra (dvc[ssh], psycopg2) in .venv.
# As root with apt-get, the missing packages are installed with their services left stopped: the stack
# starts a PostgreSQL cluster and an sshd of its own, never the system's.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "missing system packages: ${missing[*]}; install them (apt-get install ${missing[*]}) and run this again" >&2
    exit 2
  fi
  echo "installing ${missing[*]} (apt), services not started"
  guard=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then  # refuse every service start during the install
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && guard=1
  fi
  trap '[ -n "$guard" ] && rm -f /usr/sbin/policy-rc.d' EXIT
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
.venv/bin/python -m pip install -q -c constraints.txt -e '.[deploy]'
