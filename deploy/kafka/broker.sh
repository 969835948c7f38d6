#!/usr/bin/env bash
# A real single-node Apache Kafka (KRaft: broker and controller in one JVM) on
# loopback, from Maven Central's jars, for machines without Docker.
#
#   deploy/kafka/broker.sh start [--port 9092] [--dir /tmp/tokenrelay-kafka]
#   deploy/kafka/broker.sh stop  [--dir /tmp/tokenrelay-kafka]
#
# `start` fetches the jars on first use (Maven), formats the storage when the
# directory is new, starts the broker in the background with a small heap, and
# returns once a client can list topics; it prints the bootstrap address.
# `stop` ends the broker that `start` left in that directory.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
command="${1:-}"
shift || true
port=9092
dir=/tmp/tokenrelay-kafka
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
done

stop() {
  [ -f "$dir/broker.pid" ] || return 0
  pid="$(cat "$dir/broker.pid")"
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$dir/broker.pid"
}

start() {
  if [ ! -f "$here/lib/.fetched" ]; then
    mvn -q -B -f "$here/pom.xml" package >&2
    touch "$here/lib/.fetched"
  fi
  mkdir -p "$dir"
  if [ -f "$dir/broker.pid" ] && kill -0 "$(cat "$dir/broker.pid")" 2>/dev/null; then
    echo "a broker already runs from $dir" >&2
    exit 1
  fi
  controller_port=$((port + 1))
  # The test suite's settings: a group forms at once (no 3 s initial rebalance
  # delay) and accepts session timeouts down to 1 s, so that group-membership
  # tests take seconds rather than minutes. Topics are created by the
  # application, never implicitly by a typo.
  cat >"$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$controller_port
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$controller_port
advertised.listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$controller_port
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$dir/data
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
PROPS
  classpath="$here/lib/*"
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

case "$command" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop [--port N] [--dir DIR]" >&2; exit 2 ;;
esac
