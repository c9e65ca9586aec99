# shellcheck shell=bash
# Sourced by trainmover.sbatch: the job's embedded single-member etcd on the first node.
#
# start_embedded_etcd ADDR CLIENT_PORT DIR
#   Starts `etcd` (TRAINMOVER_ETCD_BINARY, else `etcd` on PATH) listening on
#   ADDR:CLIENT_PORT (clients) and ADDR:CLIENT_PORT+1 (peer), data in
#   DIR/etcd-data, log in DIR/etcd.log. Returns 0 once /health answers true
#   (within TM_ETCD_START_TIMEOUT seconds, default 30), else stops it and
#   returns 1. Sets EMBEDDED_ETCD_PID and EMBEDDED_ETCD_ENDPOINT (ADDR:PORT).
#   With ETCD_TLS_DIR set (ca.pem, server.pem/.key, member.pem/.key from
#   `python -m trainmover_ext.etcd.pki`), it serves https and requires client
#   certificates signed by that CA.
# stop_embedded_etcd
#   SIGTERM, then SIGKILL after 5 s, by pid. Safe to call twice.
#
# Needs a Python for the health probe: $ETCD_PROBE_PYTHON, default python3. etcd only accepts IP addresses
# in listen URLs, so a host name is resolved first.

start_embedded_etcd() {
  local addr=$1 port=$2 dir=$3
  local bin=${TRAINMOVER_ETCD_BINARY:-$(command -v etcd || true)}
  if [[ -z "$bin" || ! -x "$bin" ]]; then
    echo "etcd.sh: no etcd binary: install it (Debian/Ubuntu: apt-get install etcd-server), set" \
         "TRAINMOVER_ETCD_BINARY, or pass --tm-etcd-endpoints of an external etcd" >&2
    return 1
  fi
  if [[ ! "$addr" =~ ^[0-9.]+$ ]]; then
    addr=$(getent ahostsv4 "$addr" | awk 'NR == 1 {print $1}')
    [[ -n "$addr" ]] || { echo "etcd.sh: cannot resolve the first node's address to an IPv4 address" >&2; return 1; }
  fi
  local scheme=http tls_args=() probe_tls=()
  if [[ -n "${ETCD_TLS_DIR:-}" ]]; then
    scheme=https
    tls_args=(--cert-file "$ETCD_TLS_DIR/server.pem" --key-file "$ETCD_TLS_DIR/server.key"
              --trusted-ca-file "$ETCD_TLS_DIR/ca.pem" --client-cert-auth)
    probe_tls=("$ETCD_TLS_DIR/ca.pem" "$ETCD_TLS_DIR/member.pem" "$ETCD_TLS_DIR/member.key")
  fi
  local client="$scheme://$addr:$port" peer="http://$addr:$((port + 1))"
  mkdir -p "$dir"
  # A login lasts a day (clients log in again after a restart); bcrypt is cheap for random passwords.
  "$bin" --name tm0 --data-dir "$dir/etcd-data" \
    --listen-client-urls "$client" --advertise-client-urls "$client" \
    --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
    --initial-cluster "tm0=$peer" --initial-cluster-state new \
    --auth-token-ttl 86400 --bcrypt-cost 4 "${tls_args[@]}" \
    > "$dir/etcd.log" 2>&1 &
  EMBEDDED_ETCD_PID=$!
  # shellcheck disable=SC2034  # read by trainmover.sbatch, which sources this file
  EMBEDDED_ETCD_ENDPOINT="$addr:$port"
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
