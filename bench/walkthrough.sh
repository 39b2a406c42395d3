#!/usr/bin/env bash
# A new operator's first hour, timed: from a fresh clone to a served inference on the
# production-shaped stack, following only the README's commands. The stack is the one
# docker-compose.yml describes, run as processes (no container engine needed): PostgreSQL and
# Redis already running (the README's test services), moto's S3 server on loopback standing in
# for MinIO, then `kiln keys init`, `kiln store init`, `kiln api`, a worker with a worker token,
# an agent with an agent token and a serve token, `kiln submit --wait`, `kiln deploy` and a
# request to the agent. Each step's seconds and the total are printed as a table.
#
#   bash bench/walkthrough.sh [REPO]    # REPO: what to clone (default: this checkout)
#
# Needs: PostgreSQL on 127.0.0.1:5432 (trust auth, a `test` database to connect to; the script
# creates and drops its own database), Redis on 127.0.0.1:6379 (it uses database 11).
set -euo pipefail

repo=${1:-$(cd "$(dirname "$0")/.." && pwd)}
work=$(mktemp -d)
db=kiln_walkthrough_$$
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  psql -h 127.0.0.1 -U postgres -d test -qc "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() {  # URL SECONDS
  for _ in $(seq 1 $(( $2 * 5 ))); do curl -fs -o /dev/null "$1" && return 0; sleep 0.2; done
  echo "never answered: $1" >&2; return 1
}

declare -a names=() secs=()
t_start=$(date +%s.%N); t_prev=$t_start
step() {
  local now; now=$(date +%s.%N)
  names+=("$1"); secs+=("$(python3 -c "print(f'{$now - $t_prev:.1f}')")"); t_prev=$now
}

cd "$work"
git clone -q "$repo" kiln && cd kiln
step "git clone"
make install >/dev/null
step "make install (pip, wheels cached or not as the machine has them)"
export PATH="$PWD/.venv/bin:$PATH"

psql -h 127.0.0.1 -U postgres -d test -qc "CREATE DATABASE $db" >/dev/null
s3_port=$(free_port); api_port=$(free_port); agent_port=$(free_port); health_port=$(free_port)
moto_server -H 127.0.0.1 -p "$s3_port" >"$work/moto.log" 2>&1 & pids+=($!)
wait_http "http://127.0.0.1:$s3_port/" 30

# The compose file's environment, with loopback addresses for its service names.
export KILN_ENV=production
export KILN_DATABASE_URL="postgresql+psycopg://postgres@127.0.0.1:5432/$db"
export KILN_BROKER_URL="redis://127.0.0.1:6379/11"
export KILN_STORE_URI="s3://kiln-artifacts/v1"
export KILN_S3_ENDPOINT_URL="http://127.0.0.1:$s3_port"
export AWS_ACCESS_KEY_ID=operator AWS_SECRET_ACCESS_KEY=operator-secret
redis-cli -n 11 flushdb >/dev/null
step "services up (database created, S3 server started)"

KILN_HOME=./secrets kiln keys init >/dev/null
kiln store init >/dev/null
step "kiln keys init, kiln store init"

export KILN_SECRET_KEY; KILN_SECRET_KEY=$(openssl rand -hex 32)
KILN_SIGNING_KEY_PATH=$PWD/secrets/signing.key KILN_TRUST_DIR=$PWD/secrets/trust \
  kiln api --host 127.0.0.1 --port "$api_port" >"$work/api.log" 2>&1 & pids+=($!)
wait_http "http://127.0.0.1:$api_port/readyz" 120
step "kiln api ready (/readyz)"

export KILN_API_URL="http://127.0.0.1:$api_port"
export KILN_TOKEN; KILN_TOKEN=$(kiln token create --role admin 2>/dev/null)
worker_token=$(kiln token create --role worker --key '*' 2>/dev/null)
agent_token=$(kiln token create --role agent --agent node-1 2>/dev/null)
serve_token=$(openssl rand -hex 32)
(unset KILN_SECRET_KEY; KILN_WORKER_API_URL=$KILN_API_URL KILN_WORKER_TOKEN=$worker_token \
  KILN_WORKER_HEALTH_PORT=$health_port exec kiln worker --concurrency 1) \
  >"$work/worker.log" 2>&1 & pids+=($!)
wait_http "http://127.0.0.1:$health_port/readyz" 120
step "tokens minted, kiln worker ready (/readyz)"

(unset KILN_SECRET_KEY KILN_DATABASE_URL KILN_STORE_URI AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY
 KILN_ENV=production KILN_AGENT_API_URL=$KILN_API_URL KILN_AGENT_NAME=node-1 \
  KILN_AGENT_TOKEN=$agent_token KILN_AGENT_LABELS=site=walkthrough \
  KILN_AGENT_SERVE_TOKEN=$serve_token KILN_AGENT_CACHE_DIR=$work/agent-cache \
  exec kiln agent --host 127.0.0.1 --port "$agent_port" --root-key secrets/root.key.pub) \
  >"$work/agent.log" 2>&1 & pids+=($!)
wait_http "http://127.0.0.1:$agent_port/healthz" 120
step "kiln agent up (/healthz)"

# A model nobody here wrote: the squeezenet of the onnx package's light model zoo.
model=$(.venv/bin/python -c 'import onnx, pathlib; print(pathlib.Path(onnx.__file__).parent / "backend/test/data/light/light_squeezenet.onnx")')
kiln submit "$model" --wait >"$work/submit.out" 2>"$work/submit.err" || { cat "$work/submit.err" >&2; exit 1; }
model_id=$(sed -n 's/^model \([0-9a-f]\{64\}\) .*/\1/p' "$work/submit.err")
step "kiln submit --wait (upload, tune, verify, benchmark, sign, publish)"

kiln deploy "$model_id" --name squeezenet --selector site=walkthrough >/dev/null
for _ in $(seq 1 600); do
  curl -fs -o /dev/null -H "Authorization: Bearer $serve_token" \
    "http://127.0.0.1:$agent_port/v2/models/squeezenet/ready" && break
  sleep 0.1
done
python3 -c 'import json; print(json.dumps({"inputs": [{"name": "data_0", "datatype": "FP32", "shape": [1, 3, 224, 224], "data": [0.5] * (3 * 224 * 224)}]}))' >"$work/request.json"
curl -fs -H "Authorization: Bearer $serve_token" -H 'Content-Type: application/json' \
  "http://127.0.0.1:$agent_port/v2/models/squeezenet/infer" -d @"$work/request.json" \
  | python3 -c 'import json,sys; out=json.load(sys.stdin)["outputs"][0]; print("served:", out["name"], out["shape"], file=sys.stderr)'
step "kiln deploy → first inference served (OIP v2 infer)"

total=$(python3 -c "print(f'{$(date +%s.%N) - $t_start:.1f}')")
printf '\n| step | seconds |\n|---|---|\n'
for i in "${!names[@]}"; do printf '| %s | %s |\n' "${names[$i]}" "${secs[$i]}"; done
printf '| **fresh clone → served inference** | **%s** |\n' "$total"
