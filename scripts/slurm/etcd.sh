# shellcheck shell=bash
# Sourced by trainmover.sbatch and etcd_member.sh: the job's embedded etcd, one member on the first
# node, or three members on the first three nodes (one per node, so the job survives losing a node).
#
# start_embedded_etcd ADDR CLIENT_PORT DIR [NAME INITIAL_CLUSTER]
#   Starts `etcd` (TRAINMOVER_ETCD_BINARY, else `etcd` on PATH) listening on
#   ADDR:CLIENT_PORT (clients) and ADDR:CLIENT_PORT+1 (peer), data in
#   DIR/etcd-data, log in DIR/etcd.log. Returns 0 once /health answers true
#   (within TM_ETCD_START_TIMEOUT seconds, default 30), else stops it and
#   returns 1. Sets EMBEDDED_ETCD_PID and EMBEDDED_ETCD_ENDPOINT (ADDR:PORT).
#   With NAME and INITIAL_CLUSTER (name=http[s]://addr:peerport,...) it is that
#   member of a cluster: a member reports healthy only once a majority runs, so
#   start the others (etcd_member.sh) before this returns.
#   With ETCD_TLS_DIR set (ca.pem, server.pem/.key, member.pem/.key from
#   `python -m trainmover_ext.etcd.pki`), it serves https and requires client
#   certificates signed by that CA, from clients and from the other members (peer URLs are https).
# launch_etcd_member ADDR CLIENT_PORT DIR NAME INITIAL_CLUSTER
#   The same without waiting for health; sets EMBEDDED_ETCD_PID and EMBEDDED_ETCD_URL.
# stop_embedded_etcd
#   SIGTERM, then SIGKILL after 5 s, by pid. Safe to call twice.
#
# Needs a Python for the health probe: $ETCD_PROBE_PYTHON, default python3. etcd only accepts IP addresses
# in listen URLs, so a host name is resolved first.

launch_etcd_member() {
  local addr=$1 port=$2 dir=$3 name=$4 initial=$5
  local bin=${TRAINMOVER_ETCD_BINARY:-$(command -v etcd || true)}
  if [[ -z "$bin" || ! -x "$bin" ]]; then
    echo "etcd.sh: no etcd binary: install it (Debian/Ubuntu: apt-get install etcd-server), set" \
         "TRAINMOVER_ETCD_BINARY, or pass --tm-etcd-endpoints of an external etcd" >&2
    return 1
  fi
  addr=$(etcd_ipv4 "$addr") || return 1
  local scheme=http tls_args=()
  if [[ -n "${ETCD_TLS_DIR:-}" ]]; then
    scheme=https
    # Peers too: a member accepts only another member with a certificate of the job CA (the server
    # certificate is for server and client use, and names every member's address).
    tls_args=(--cert-file "$ETCD_TLS_DIR/server.pem" --key-file "$ETCD_TLS_DIR/server.key"
              --trusted-ca-file "$ETCD_TLS_DIR/ca.pem" --client-cert-auth
              --peer-cert-file "$ETCD_TLS_DIR/server.pem" --peer-key-file "$ETCD_TLS_DIR/server.key"
              --peer-trusted-ca-file "$ETCD_TLS_DIR/ca.pem" --peer-client-cert-auth)
  fi
  local client="$scheme://$addr:$port" peer="$scheme://$addr:$((port + 1))"
  [[ -n "$initial" ]] || initial="$name=$peer"
  mkdir -p "$dir"
  # A login lasts a day (clients log in again after a restart); bcrypt is cheap for random passwords.
  "$bin" --name "$name" --data-dir "$dir/etcd-data" \
    --listen-client-urls "$client" --advertise-client-urls "$client" \
    --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
    --initial-cluster "$initial" --initial-cluster-state new \
    --auth-token-ttl 86400 --bcrypt-cost 4 "${tls_args[@]}" \
    > "$dir/etcd.log" 2>&1 &
  EMBEDDED_ETCD_PID=$!
  EMBEDDED_ETCD_URL=$client
  # shellcheck disable=SC2034  # read by trainmover.sbatch, which sources this file
  EMBEDDED_ETCD_ENDPOINT="$addr:$port"
}

etcd_ipv4() {
  local addr=$1
  if [[ ! "$addr" =~ ^[0-9.]+$ ]]; then
    addr=$(getent ahostsv4 "$addr" | awk 'NR == 1 {print $1}')
    [[ -n "$addr" ]] || { echo "etcd.sh: cannot resolve $1 to an IPv4 address" >&2; return 1; }
  fi
  echo "$addr"
}

start_embedded_etcd() {
  local dir=$3 probe_tls=()
  launch_etcd_member "$1" "$2" "$dir" "${4:-tm0}" "${5:-}" || return 1
  local client=$EMBEDDED_ETCD_URL
  if [[ -n "${ETCD_TLS_DIR:-}" ]]; then
    probe_tls=("$ETCD_TLS_DIR/ca.pem" "$ETCD_TLS_DIR/member.pem" "$ETCD_TLS_DIR/member.key")
  fi
  if ! "${ETCD_PROBE_PYTHON:-python3}" - "$client/health" "${TM_ETCD_START_TIMEOUT:-30}" "$EMBEDDED_ETCD_PID" \
       "${probe_tls[@]}" <<'PYEOF'
import os, ssl, sys, time, urllib.request
url, timeout, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
ctx = None
if len(sys.argv) > 4:  # https: the job CA, and the member certificate the server requires
    ctx = ssl.create_default_context(cafile=sys.argv[4])
    ctx.load_cert_chain(sys.argv[5], sys.argv[6])
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("etcd.sh: etcd exited during start-up (port in use?)")
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
            if b'"true"' in resp.read():
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.2)
sys.exit(f"etcd.sh: {url} not healthy after {timeout}s")
PYEOF
  then
    tail -n 15 "$dir/etcd.log" >&2
    stop_embedded_etcd
    return 1
  fi
}

stop_embedded_etcd() {
  local pid=${EMBEDDED_ETCD_PID:-}
  [[ -n "$pid" ]] || return 0
  EMBEDDED_ETCD_PID=
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
}
