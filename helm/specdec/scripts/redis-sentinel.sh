#!/bin/sh
# Redis with Sentinel failover (redis.mode: sentinel): every pod of the StatefulSet runs one Redis
# and one Sentinel.
#
#   redis-sentinel.sh redis [ARGS...]     start Redis (ARGS: redis-server options) as the master, or
#                                         as a replica of the master
#   redis-sentinel.sh sentinel [ARGS...]  start a Sentinel that watches the master
#   redis-sentinel.sh pre-stop            hand the master role to a replica before this Redis stops,
#                                         so that a rolling update or a drained node costs no outage
#                                         (through the other pods' Sentinels: Kubernetes stops this
#                                         pod's own at once)
#
# The master is the one the Sentinels name. When none answers (the first start, or every Sentinel
# restarting at once) it is a peer that says it is a master, and when none does, the first pod.
# Addresses are DNS names (the pods of a headless Service): a pod keeps its name, not its IP.
#
# Environment: ANNOUNCE (this pod's address), PEERS (every pod's address, the first pod first),
# REDIS_PORT, SENTINEL_PORT, MASTER_NAME, QUORUM, DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS,
# SENTINEL_DIR (a writable folder: Sentinel rewrites its configuration), PRE_STOP_WAIT_SECONDS;
# REDIS_PASSWORD and REDISCLI_AUTH when Redis has a password (it guards the Sentinels too);
# LOCAL_HOST (default 127.0.0.1): where this pod's Redis and Sentinel answer.
set -eu

# ask HOST PORT COMMAND...: the first line of the reply; empty when there is none.
ask() {
  host=$1 port=$2
  shift 2
  timeout 3 redis-cli --raw -h "$host" -p "$port" "$@" 2>/dev/null | head -n 1 || true
}

find_master() {
  for peer in $PEERS; do
    master=$(ask "$peer" "$SENTINEL_PORT" SENTINEL get-master-addr-by-name "$MASTER_NAME")
    case $master in
      "" | *" "*) ;;  # no Sentinel there, or an error such as "NOAUTH ..."
      *) echo "$master"; return ;;
    esac
  done
  for peer in $PEERS; do
    if [ "$(ask "$peer" "$REDIS_PORT" ROLE)" = master ]; then
      echo "$peer"
      return
    fi
  done
  # shellcheck disable=SC2086 # one word a peer
  set -- $PEERS
  echo "$1"
}

start_redis() {
  master=$(find_master)
  echo "master: $master (this pod: $ANNOUNCE)" >&2
  if [ "$master" != "$ANNOUNCE" ]; then
    set -- "$@" --replicaof "$master" "$REDIS_PORT"
  fi
  if [ -n "${REDIS_PASSWORD:-}" ]; then
    set -- "$@" --masterauth "$REDIS_PASSWORD"
  fi
  exec redis-server "$@" --replica-announce-ip "$ANNOUNCE"
}

start_sentinel() {
  master=$(find_master)
  echo "master: $master (this pod: $ANNOUNCE)" >&2
  conf=$SENTINEL_DIR/sentinel.conf
  umask 077
  {
    echo "port $SENTINEL_PORT"
    echo "protected-mode no"
    echo "dir $SENTINEL_DIR"
    # A pod keeps its Sentinel id across restarts, so the other Sentinels never count a ghost.
    echo "sentinel myid $(printf %s "$ANNOUNCE" | sha1sum | cut -c1-40)"
    echo "sentinel resolve-hostnames yes"
    echo "sentinel announce-hostnames yes"
    echo "sentinel announce-ip $ANNOUNCE"
    echo "sentinel monitor $MASTER_NAME $master $REDIS_PORT $QUORUM"
    echo "sentinel down-after-milliseconds $MASTER_NAME $DOWN_AFTER_MS"
    echo "sentinel failover-timeout $MASTER_NAME $FAILOVER_TIMEOUT_MS"
    echo "sentinel parallel-syncs $MASTER_NAME 1"
    if [ -n "${REDIS_PASSWORD:-}" ]; then
      echo "requirepass \"$REDIS_PASSWORD\""
      echo "sentinel auth-pass $MASTER_NAME \"$REDIS_PASSWORD\""
    fi
  } >"$conf"
  exec redis-server "$conf" --sentinel "$@"
}

# ask_sentinels COMMAND...: the first answer, not an error, of another pod's Sentinel (this pod's
# own is stopping too); empty when there is none.
ask_sentinels() {
  for peer in $PEERS; do
    [ "$peer" != "$ANNOUNCE" ] || continue
    reply=$(ask "$peer" "$SENTINEL_PORT" "$@")
    case $reply in
      "" | *" "*) ;;
      *) echo "$reply"; return ;;
    esac
  done
}

pre_stop() {
  local_host=${LOCAL_HOST:-127.0.0.1}
  [ "$(ask "$local_host" "$REDIS_PORT" ROLE)" = master ] || return 0
  wait_seconds=${PRE_STOP_WAIT_SECONDS:-20}
  # No write may land here once a replica has been promoted: it would be lost.
  ask "$local_host" "$REDIS_PORT" CLIENT PAUSE "$((wait_seconds * 1000))" WRITE >/dev/null
  waited=0
  while [ "$waited" -lt "$wait_seconds" ]; do
    master=$(ask_sentinels SENTINEL get-master-addr-by-name "$MASTER_NAME")
    if [ -n "$master" ] && [ "$master" != "$ANNOUNCE" ]; then
      echo "master now: $master" >&2
      return 0
    fi
    # Asked again until it takes: a Sentinel that has not yet seen a replica up to date answers
    # NOGOODSLAVE, one that is failing over already INPROG.
    ask_sentinels SENTINEL FAILOVER "$MASTER_NAME" >&2
    sleep 1
    waited=$((waited + 1))
  done
  echo "no replica took over in ${wait_seconds}s; stopping anyway" >&2
}

command=${1:?usage: redis-sentinel.sh redis|sentinel|pre-stop [ARGS...]}
shift
case $command in
  redis) start_redis "$@" ;;
  sentinel) start_sentinel "$@" ;;
  pre-stop) pre_stop ;;
  *) echo "unknown command: $command" >&2; exit 2 ;;
esac
