#!/usr/bin/env bash
# A separate environment for the tests that run third-party clients against `inferscale serve`
# (today the open-source mem0ai library): the clients pin versions of shared packages (mem0ai:
# protobuf < 7) that the serving environment does not use, and a client talks to the server over
# HTTP only. Best effort: when a client cannot be installed, the reason is written to
# $CLIENT_VENV/.failed and its test is skipped with that reason.
set -uo pipefail
PY=${PY:-python3}
CLIENT_VENV=${CLIENT_VENV:-.venv-clients}
MEM0=${MEM0:-mem0ai==2.2.1}

rm -f "$CLIENT_VENV/.failed"
if ! { [ -x "$CLIENT_VENV/bin/python" ] || "$PY" -m venv "$CLIENT_VENV"; } ; then
    mkdir -p "$CLIENT_VENV" && echo "could not create a virtual environment with $PY" > "$CLIENT_VENV/.failed"
    exit 0
fi
if ! log=$("$CLIENT_VENV/bin/python" -m pip install -q --no-compile "$MEM0" 2>&1); then
    printf 'pip could not install %s:\n%s\n' "$MEM0" "$(echo "$log" | tail -5)" > "$CLIENT_VENV/.failed"
    echo "the client tests will be skipped: $(head -1 "$CLIENT_VENV/.failed")"
fi
exit 0
