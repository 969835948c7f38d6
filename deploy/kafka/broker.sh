#!/usr/bin/env bash
# A real Apache Kafka (KRaft) on loopback, from Maven Central's jars, for
# machines without Docker: one node by default, or a replicated cluster of
# several, as production runs it.
#
#   deploy/kafka/broker.sh start [--port 9092] [--dir /tmp/tokenrelay-kafka] [--brokers 1]
#   deploy/kafka/broker.sh stop  [--dir /tmp/tokenrelay-kafka]
#   deploy/kafka/broker.sh kill       --node N [--dir ...]   # SIGKILL one node of a cluster
#   deploy/kafka/broker.sh start-node --node N [--dir ...]   # start it again
#
# `start` fetches the jars on first use (Maven), formats the storage when the
# directory is new, starts the broker in the background with a small heap, and
# returns once a client can list topics; it prints the bootstrap address.
# `stop` ends the broker (or every node of the cluster) that `start` left in
# that directory.
#
# With --brokers N (3 or more) `start` runs N nodes, each a broker and a
# controller in one JVM, node i (1..N) in DIR/node<i> on client port
# PORT+2(i-1) and controller port PORT+2(i-1)+1 (the single node's layout,
# repeated), and prints the bootstrap list, comma-separated. Every node is a
# voter of the controller quorum, so a majority (2 of 3) keeps metadata and
# leader elections going when one dies. Topics default to replication 3 and
# min.insync.replicas 2: an acks=all write is on two nodes before it is
# acknowledged, and a topic keeps taking writes with one node down.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
command="${1:-}"
shift || true
port=9092
dir=/tmp/tokenrelay-kafka
brokers=1
node=""
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --brokers) brokers="$2"; shift 2 ;;
    --node) node="$2"; shift 2 ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
done
classpath="$here/lib/*"

# Ends the JVM whose pid is in $1 (SIGTERM, a clean shutdown; SIGKILL after 10 s).
stop_pidfile() {
  pid="$(cat "$1")"
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    echo "stopped the Kafka broker of $(dirname "$1") (pid $pid)" >&2
  else
    echo "the Kafka broker of $(dirname "$1") (pid $pid) had already exited" >&2
  fi
  rm -f "$1"
}

stop() {
  # A cluster's nodes all at once: one by one, each clean shutdown would wait
  # for its partitions' leadership to move to nodes about to stop too.
  found=0
  for pidfile in "$dir/broker.pid" "$dir"/node*/broker.pid; do
    [ -f "$pidfile" ] || continue
    found=1
    stop_pidfile "$pidfile" &
  done
  wait
  [ "$found" = 1 ] || echo "no Kafka broker runs from $dir: nothing to stop" >&2
}

fetch_jars() {
  if [ ! -f "$here/lib/.fetched" ]; then
    mvn -q -B -f "$here/pom.xml" package >&2
    touch "$here/lib/.fetched"
  fi
}

# Writes $2/server.properties: node $1, a broker and a controller in one JVM, clients on port $3 and its
# controller on the next port, the controller quorum at $4 (HOST:PORT, comma-separated), every topic $5
# times: 1 for the single node, 3 for a cluster.
#
# Both get the test suite's group settings: a group forms at once (no 3 s
# initial rebalance delay) and accepts session timeouts down to 1 s, so that
# group-membership tests take seconds rather than minutes. Topics are created
# by the application, never implicitly by a typo.
#
# A cluster gets production's replication: three copies of every topic (the
# internal ones too: group offsets, transactions, share groups), two of which
# must hold a write before acks=all acknowledges it, and a replica that missed
# writes never becomes leader (no unclean election: nothing acknowledged is
# lost). And failure detection: a broker that sends the active controller no
# heartbeat for broker.session.timeout.ms is fenced and its partitions get new
# leaders from their in-sync replicas. Production's 9 s would keep producers
# waiting on a dead leader that long; 4 s with a heartbeat a second still
# leaves a busy 2-core machine room for GC pauses. A controller quorum
# without its leader elects another after controller.quorum.fetch.timeout.ms
# plus up to controller.quorum.election.timeout.ms (Kafka's defaults, written
# out so that tests can read the bounds here).
write_properties() {
  local id="$1" home="$2" client_port="$3" controllers="$4" replicas="$5" in_sync=1
  [ "$replicas" -gt 1 ] && in_sync=2
  mkdir -p "$home"
  {
    cat <<PROPS
process.roles=broker,controller
node.id=$id
controller.quorum.bootstrap.servers=$controllers
listeners=PLAINTEXT://127.0.0.1:$client_port,CONTROLLER://127.0.0.1:$((client_port + 1))
advertised.listeners=PLAINTEXT://127.0.0.1:$client_port,CONTROLLER://127.0.0.1:$((client_port + 1))
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$home/data
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=$replicas
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=$replicas
transaction.state.log.min.isr=$in_sync
share.coordinator.state.topic.replication.factor=$replicas
share.coordinator.state.topic.min.isr=$in_sync
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
PROPS
    if [ "$replicas" -gt 1 ]; then
      cat <<PROPS
default.replication.factor=$replicas
min.insync.replicas=$in_sync
unclean.leader.election.enable=false
broker.heartbeat.interval.ms=1000
broker.session.timeout.ms=4000
controller.quorum.fetch.timeout.ms=2000
controller.quorum.election.timeout.ms=1000
PROPS
    fi
  } >"$home/server.properties"
}

start() {
  fetch_jars
  mkdir -p "$dir"
  if [ -f "$dir/broker.pid" ] && kill -0 "$(cat "$dir/broker.pid")" 2>/dev/null; then
    echo "a broker already runs from $dir" >&2
    exit 1
  fi
  write_properties 1 "$dir" "$port" "127.0.0.1:$((port + 1))" 1
  java_opts=(-Xms128m -Xmx512m -XX:+UseSerialGC -Dlog4j2.configurationFile="$here/log4j2.properties"
             -Dkafka.logs.dir="$dir")
  if [ ! -f "$dir/data/meta.properties" ]; then
    java "${java_opts[@]}" -cp "$classpath" kafka.tools.StorageTool format --standalone \
      -t "$(java -cp "$classpath" kafka.tools.StorageTool random-uuid)" \
      -c "$dir/server.properties" >"$dir/format.log" 2>&1
  fi
  nohup java "${java_opts[@]}" -cp "$classpath" kafka.Kafka "$dir/server.properties" \
    >"$dir/broker.log" 2>&1 </dev/null &
  echo $! >"$dir/broker.pid"
  for _ in $(seq 120); do
    if ! kill -0 "$(cat "$dir/broker.pid")" 2>/dev/null; then
      echo "the broker exited; see $dir/broker.log" >&2
      tail -n 20 "$dir/broker.log" >&2
      exit 1
    fi
    if java -Xmx128m -cp "$classpath" -Dlog4j2.configurationFile="$here/log4j2.properties" \
         org.apache.kafka.tools.TopicCommand --bootstrap-server "127.0.0.1:$port" --list >/dev/null 2>&1; then
      echo "127.0.0.1:$port"
      return 0
    fi
    sleep 0.5
  done
  echo "the broker did not answer within a minute; see $dir/broker.log" >&2
  stop
  exit 1
}

# ---- A cluster: --brokers N (N >= 3) ----------------------------------------

# The JVM options of a node whose files are in $1: the single node's small heap,
# and only the quick JIT compiler (C1), since three JVMs starting at once on a
# small machine spend most of their start compiling; a local broker's load
# never needs C2's faster code.
java_opts_of() {
  echo -Xms128m -Xmx512m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 \
    -Dlog4j2.configurationFile="$here/log4j2.properties" -Dkafka.logs.dir="$1"
}

# A Kafka Uuid: 16 random bytes, URL-safe base64 without padding, never
# starting with "-" (it would read as a flag). Made here rather than by
# `StorageTool random-uuid`: each JVM start costs seconds on a small machine.
uuid() {
  local id
  while :; do
    id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"
    if [ "${id:0:1}" != "-" ]; then echo "$id"; return; fi
  done
}

# Exits 0 once a broker of the bootstrap list $1 lists every node of $2 (ids,
# space-separated) among its live (unfenced) brokers, and each of them answers:
# they have caught up with the metadata and can lead partitions. One JVM asks
# for all of them, since each JVM start costs seconds.
lists_nodes() {
  local listed
  listed="$(java -Xmx128m -XX:TieredStopAtLevel=1 -cp "$classpath" \
    -Dlog4j2.configurationFile="$here/log4j2.properties" \
    org.apache.kafka.tools.BrokerApiVersionsCommand --bootstrap-server "$1" 2>/dev/null)" || return 1
  for id in $2; do
    grep -q "(id: $id " <<<"$listed" || return 1
  done
}

node_running() {
  [ -f "$dir/node$1/broker.pid" ] && kill -0 "$(cat "$dir/node$1/broker.pid")" 2>/dev/null
}

launch_node() {  # starts node $1's JVM in the background, from its formatted directory
  local home="$dir/node$1"
  # shellcheck disable=SC2046
  nohup java $(java_opts_of "$home") -cp "$classpath" kafka.Kafka "$home/server.properties" \
    >>"$home/broker.log" 2>&1 </dev/null &
  echo $! >"$home/broker.pid"
}

client_port_of() {  # node $1's client port, from its server.properties
  sed -n 's/^listeners=PLAINTEXT:\/\/127.0.0.1:\([0-9]*\),.*/\1/p' "$dir/node$1/server.properties"
}

# Waits until every node of $1 (ids, space-separated) runs, answers and is live.
await_nodes() {
  local bootstrap=()
  for id in $1; do bootstrap+=("127.0.0.1:$(client_port_of "$id")"); done
  for _ in $(seq 120); do
    for id in $1; do
      if ! node_running "$id"; then
        echo "node $id exited; see $dir/node$id/broker.log" >&2
        tail -n 20 "$dir/node$id/broker.log" >&2
        return 1
      fi
    done
    if lists_nodes "$(IFS=,; echo "${bootstrap[*]}")" "$1"; then return 0; fi
    sleep 0.5
  done
  echo "nodes $1 did not answer within a minute; see $dir/node*/broker.log" >&2
  return 1
}

write_node_config() {  # node $1's server.properties, for a cluster of $brokers nodes from $port
  local controllers=()
  for n in $(seq "$brokers"); do controllers+=("127.0.0.1:$((port + 2 * (n - 1) + 1))"); done
  write_properties "$1" "$dir/node$1" "$((port + 2 * ($1 - 1)))" "$(IFS=,; echo "${controllers[*]}")" 3
}

start_cluster() {
  fetch_jars
  mkdir -p "$dir"
  if [ -f "$dir/cluster" ]; then
    # Formatted before: the quorum's addresses are in each node's metadata log,
    # so the ports stay those of the first start.
    # shellcheck disable=SC1091
    . "$dir/cluster"
  else
    if [ "$brokers" -lt 3 ]; then
      # Two voters cannot elect a controller when one is gone, and two
      # replicas with min.insync.replicas=2 take no writes: no better than one.
      echo "a cluster needs --brokers 3 or more (1: a single node)" >&2
      exit 2
    fi
    # The same cluster id and initial voters (id@host:port:directory-id) for
    # every node: KIP-853's dynamic quorum, formatted as Kafka 4's docs show.
    cluster_id="$(uuid)"
    voters=()
    for i in $(seq "$brokers"); do
      write_node_config "$i"
      voters+=("$i@127.0.0.1:$((port + 2 * (i - 1) + 1)):$(uuid)")
    done
    formats=()
    for i in $(seq "$brokers"); do  # each format is a JVM: all at once
      home="$dir/node$i"
      # shellcheck disable=SC2046
      java $(java_opts_of "$home") -cp "$classpath" kafka.tools.StorageTool format -t "$cluster_id" \
        -c "$home/server.properties" --initial-controllers "$(IFS=,; echo "${voters[*]}")" \
        >"$home/format.log" 2>&1 &
      formats+=($!)
    done
    for i in $(seq "$brokers"); do
      if ! wait "${formats[$((i - 1))]}"; then
        echo "formatting node $i failed; see $dir/node$i/format.log" >&2
        tail -n 20 "$dir/node$i/format.log" >&2
        exit 1
      fi
    done
    printf 'brokers=%s\nport=%s\n' "$brokers" "$port" >"$dir/cluster"
  fi
  for i in $(seq "$brokers"); do
    if node_running "$i"; then
      echo "node $i already runs from $dir/node$i" >&2
      exit 1
    fi
  done
  for i in $(seq "$brokers"); do launch_node "$i"; done
  if ! await_nodes "$(seq -s ' ' "$brokers")"; then
    stop
    exit 1
  fi
  bootstrap=()
  for i in $(seq "$brokers"); do bootstrap+=("127.0.0.1:$((port + 2 * (i - 1)))"); done
  (IFS=,; echo "${bootstrap[*]}")
}

# The failure a test wants: a node gone at once, without a clean shutdown
# (no leadership handed over, no controlled shutdown message).
kill_node() {
  [ -n "$node" ] || { echo "kill: --node N" >&2; exit 2; }
  local pidfile="$dir/node$node/broker.pid"
  [ -f "$pidfile" ] || { echo "node $node does not run from $dir" >&2; exit 1; }
  pid="$(cat "$pidfile")"
  kill -9 "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  rm -f "$pidfile"
}

start_node() {
  [ -n "$node" ] || { echo "start-node: --node N" >&2; exit 2; }
  [ -f "$dir/node$node/data/meta.properties" ] || { echo "no node $node in $dir" >&2; exit 1; }
  if node_running "$node"; then
    echo "node $node already runs" >&2
    exit 1
  fi
  launch_node "$node"
  await_nodes "$node" || exit 1
}

case "$command" in
  start) if [ "$brokers" = 1 ] && [ ! -f "$dir/cluster" ]; then start; else start_cluster; fi ;;
  stop) stop ;;
  kill) kill_node ;;
  start-node) start_node ;;
  *) echo "usage: $0 start|stop|kill|start-node [--port N] [--dir DIR] [--brokers N] [--node N]" >&2; exit 2 ;;
esac
