#!/usr/bin/env bash
# cluster.sh: run a quotaring cluster of N nodes on this machine, for trying it
# out. It builds quotad, starts a throwaway Postgres from the local binaries,
# migrates it, starts N `quotad serve` on 127.0.0.11, 127.0.0.12, ... (Linux
# routes all of 127.0.0.0/8 to loopback), waits until each is ready, and prints
# their addresses.
#
#   deploy/local/cluster.sh [start] [--nodes N] [--dir DIR] [--quotad PATH]
#                           [--detach] [--keep] [--timeout SECONDS]
#   deploy/local/cluster.sh stop --dir DIR [--keep]
#
# start (the default) runs in the foreground: Ctrl-C (or SIGTERM; a script that
# starts it in the background, where SIGINT is ignored, sends SIGTERM) stops the
# nodes gracefully, then Postgres, and removes DIR. With --detach it returns
# once the cluster is ready and leaves it running; `cluster.sh stop --dir DIR`
# stops it. Either way only the processes it started are signalled (their PIDs
# are in DIR/pids, checked against /proc before any signal).
#
# Needs: go (unless --quotad), and the Postgres server binaries (initdb,
# pg_ctl, postgres) on PATH or in /usr/lib/postgresql/*/bin. As root, Postgres
# runs as the "postgres" user (runuser), which must be able to reach DIR.
#
# DIR (default: a new /tmp/quotaring-local.XXXXXX) holds everything: the
# binary, Postgres's data and log, each node's data dir and log, pids, and
# cluster.env (the ledger DSN and the nodes' addresses, for scripts).

set -euo pipefail

prog=${0##*/}
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/../.." && pwd)

die() {
	echo "$prog: error: $*" >&2
	exit 1
}
say() { echo "$prog: $*"; }

usage() {
	sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$0"
}

# ---------------------------------------------------------------- arguments

cmd=start
nodes=3
dir=
quotad=
detach=false
keep=false
timeout=90
if [[ $# -gt 0 && $1 != -* ]]; then
	cmd=$1
	shift
fi
while [[ $# -gt 0 ]]; do
	case $1 in
	--nodes) nodes=${2:?--nodes needs a number}; shift 2 ;;
	--nodes=*) nodes=${1#*=}; shift ;;
	--dir) dir=${2:?--dir needs a path}; shift 2 ;;
	--dir=*) dir=${1#*=}; shift ;;
	--quotad) quotad=${2:?--quotad needs a path}; shift 2 ;;
	--quotad=*) quotad=${1#*=}; shift ;;
	--timeout) timeout=${2:?--timeout needs seconds}; shift 2 ;;
	--timeout=*) timeout=${1#*=}; shift ;;
	--detach) detach=true; shift ;;
	--keep) keep=true; shift ;;
	-h | --help) usage; exit 0 ;;
	*) die "unknown argument '$1' (see $prog --help)" ;;
	esac
done
case $cmd in
start | stop) ;;
*) die "unknown command '$cmd': want start or stop (see $prog --help)" ;;
esac
[[ $nodes =~ ^[0-9]+$ ]] && ((nodes >= 1 && nodes <= 200)) || die "--nodes $nodes: want a number from 1 to 200"
[[ $timeout =~ ^[0-9]+$ ]] && ((timeout >= 1)) || die "--timeout $timeout: want a number of seconds"

# The shutdown budgets the nodes get, and how long stop waits for them:
# quotad serve bounds its shutdown by drain + settle + 17s (10s for the
# hand-back and leaving, 5s to close the ring, 2s for the ledger's
# connections); 3s more for the process to exit.
drain_timeout=5
settle_timeout=10
stop_wait=$((drain_timeout + settle_timeout + 20))

marker=.quotaring-local-cluster

# ---------------------------------------------------------------- processes

# is_ours PID WHAT: the process PID is alive and is what we started: a
# quotad serve whose data dir is in our dir, or the postgres whose data dir is
# ours. A PID in DIR/pids that has been reused by someone else's process is
# never signalled.
is_ours() {
	local pid=$1 what=$2 cmdline
	[[ $pid =~ ^[0-9]+$ ]] || return 1
	[[ -r /proc/$pid/cmdline ]] || return 1
	cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
	case $what in
	postgres) [[ $cmdline == *postgres* && $cmdline == *" -D $dir/pg/data "* ]] ;;
	*) [[ $cmdline == *" serve "* && $cmdline == *" --data-dir $dir/nodes/"* ]] ;;
	esac
}

alive() {
	[[ -d /proc/$1 ]] || return 1
	# A zombie is dead for our purposes (its parent has not reaped it yet).
	[[ $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) != Z ]]
}

# as_pg CMD...: run a Postgres binary as the postgres user when we are root
# (initdb and postgres refuse to run as root).
as_pg() {
	if ((EUID == 0)); then
		runuser -u postgres -- "$@"
	else
		"$@"
	fi
}

find_pg_bin() {
	local d
	if command -v initdb >/dev/null && command -v pg_ctl >/dev/null && command -v postgres >/dev/null; then
		# Through symlinks (/usr/local/bin/pg_ctl -> .../15/bin/pg_ctl), so
		# that createdb is found beside them.
		dirname "$(readlink -f "$(command -v pg_ctl)")"
		return
	fi
	# Debian's postgresql packages keep them off PATH; take the newest.
	for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k4 -n -r); do
		if [[ -x $d/initdb && -x $d/pg_ctl && -x $d/postgres ]]; then
			echo "$d"
			return
		fi
	done
	return 1
}

# port_busy HOST PORT: something accepts TCP connections there (a listener on
# that address or on a wildcard address).
port_busy() {
	(exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

# stop_all: stop the nodes (SIGTERM: drain, settle, exit), then Postgres, then
# remove the dir unless --keep. Idempotent; used by stop and by the trap.
stopping=false
stop_all() {
	$stopping && return 0
	stopping=true
	trap - INT TERM
	local pidfile=$dir/pids name pid pids=() names=() waited=0 left
	if [[ -f $pidfile ]]; then
		while read -r name pid; do
			[[ $name == postgres ]] && continue
			if is_ours "$pid" quotad; then
				kill -TERM "$pid" 2>/dev/null || true
				pids+=("$pid")
				names+=("$name")
			fi
		done <"$pidfile"
	fi
	if ((${#pids[@]} > 0)); then
		say "stopping ${#pids[@]} node(s) (drain, final settle; up to ${stop_wait}s)"
	fi
	while ((${#pids[@]} > 0)); do
		left=()
		for pid in "${pids[@]}"; do
			if alive "$pid"; then left+=("$pid"); fi
		done
		pids=("${left[@]}")
		((${#pids[@]} == 0)) && break
		if ((waited >= stop_wait * 10)); then
			say "node(s) ${pids[*]} still running after ${stop_wait}s: killing them (their records stay in their logs)"
			for pid in "${pids[@]}"; do
				is_ours "$pid" quotad && kill -KILL "$pid" 2>/dev/null || true
			done
			sleep 0.2
			break
		fi
		sleep 0.1
		waited=$((waited + 1))
	done
	if [[ -f $pidfile ]]; then
		pid=$(awk '$1 == "postgres" {print $2}' "$pidfile")
		if [[ -n $pid ]] && is_ours "$pid" postgres; then
			say "stopping postgres"
			if ! as_pg "$pg_bin/pg_ctl" -D "$dir/pg/data" -m fast -w -t 30 stop >/dev/null 2>&1; then
				is_ours "$pid" postgres && kill -QUIT "$pid" 2>/dev/null || true
			fi
		fi
	fi
	if $keep; then
		say "kept $dir"
	elif [[ -f $dir/$marker ]]; then
		if [[ $(cat "$dir/$marker") == created ]]; then
			rm -rf -- "$dir"
		else
			# --dir named an existing empty dir: empty it again, keep it.
			find "$dir" -mindepth 1 -delete
		fi
		say "removed $dir"
	fi
}

# ---------------------------------------------------------------- stop

if [[ $cmd == stop ]]; then
	[[ -n $dir ]] || die "stop needs --dir DIR (the dir start printed)"
	dir=$(cd "$dir" 2>/dev/null && pwd) || die "--dir: no such directory"
	[[ -f $dir/$marker ]] || die "$dir was not made by $prog (no $marker): not touching it"
	pg_bin=$(find_pg_bin) || pg_bin=
	stop_all
	exit 0
fi

# ---------------------------------------------------------------- start

pg_bin=$(find_pg_bin) || die "the Postgres server binaries (initdb, pg_ctl, postgres) are not on PATH or in /usr/lib/postgresql/*/bin; install postgresql (Debian: apt-get install postgresql)"
if ((EUID == 0)); then
	id postgres >/dev/null 2>&1 || die "running as root, Postgres must run as the 'postgres' user, which does not exist"
	command -v runuser >/dev/null || die "running as root needs runuser (util-linux) to start Postgres as 'postgres'"
fi
command -v curl >/dev/null || die "curl is needed to wait for the nodes' /readyz"
command -v setsid >/dev/null || die "setsid (util-linux) is needed to keep Ctrl-C from reaching the nodes before they are told to stop"

created=created
if [[ -z $dir ]]; then
	dir=$(mktemp -d /tmp/quotaring-local.XXXXXX)
else
	if [[ -e $dir ]]; then
		[[ -d $dir ]] || die "--dir $dir exists and is not a directory"
		[[ -z $(ls -A "$dir") ]] || die "--dir $dir is not empty; give a new or empty directory"
		created=existing
	else
		mkdir -p -- "$dir"
	fi
	dir=$(cd "$dir" && pwd)
fi
echo "$created" >"$dir/$marker"
: >"$dir/pids"

trap 'echo; stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
# On an error during start, stop what was started.
started=false
trap '$started || { echo "$prog: start failed; cleaning up" >&2; stop_all; }' EXIT

# The postgres user must reach DIR: give it a searchable mode (mktemp makes it
# 0700) and check every ancestor.
chmod 0755 "$dir"
mkdir -p "$dir/pg" "$dir/bin" "$dir/nodes"
if ((EUID == 0)); then
	chown postgres: "$dir/pg"
	runuser -u postgres -- test -w "$dir/pg" ||
		die "the postgres user cannot reach $dir/pg (an ancestor of $dir is not searchable by it); pick a --dir under /tmp"
fi

# Build quotad the way the Dockerfile does.
if [[ -z $quotad ]]; then
	command -v go >/dev/null || die "go is not on PATH: install Go or pass --quotad PATH to a built quotad"
	say "building quotad"
	(cd "$repo_root" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$dir/bin/quotad" ./cmd/quotad) || die "go build ./cmd/quotad failed"
	quotad=$dir/bin/quotad
else
	[[ -x $quotad ]] || die "--quotad $quotad is not an executable"
	quotad=$(cd "$(dirname "$quotad")" && pwd)/$(basename "$quotad")
fi

# Postgres on a free loopback port, trusted local connections, no socket file
# outside its dir.
pg_port=
for p in $(seq 15432 15531); do
	if ! port_busy 127.0.0.1 "$p"; then
		pg_port=$p
		break
	fi
done
[[ -n $pg_port ]] || die "no free port for Postgres in 15432-15531"
say "starting postgres on 127.0.0.1:$pg_port ($pg_bin)"
as_pg "$pg_bin/initdb" -D "$dir/pg/data" -A trust -U postgres -E UTF8 --locale=C --no-sync >"$dir/pg/initdb.log" 2>&1 ||
	die "initdb failed: $(tail -n 5 "$dir/pg/initdb.log")"
if ! as_pg "$pg_bin/pg_ctl" -D "$dir/pg/data" -l "$dir/pg/postgres.log" -w -t 60 \
	-o "-h 127.0.0.1 -p $pg_port -k '' -c fsync=off -c full_page_writes=off -c timezone=UTC" start >/dev/null; then
	die "postgres did not start: $(tail -n 5 "$dir/pg/postgres.log" 2>/dev/null)"
fi
pg_pid=$(head -n 1 "$dir/pg/data/postmaster.pid")
echo "postgres $pg_pid" >>"$dir/pids"
db=postgres
if [[ -x $pg_bin/createdb ]] && as_pg "$pg_bin/createdb" -h 127.0.0.1 -p "$pg_port" -U postgres quotaring 2>"$dir/pg/createdb.log"; then
	db=quotaring
fi
dsn="postgres://postgres@127.0.0.1:$pg_port/$db?sslmode=disable"

say "migrating the ledger"
"$quotad" migrate --ledger "$dsn" || die "quotad migrate failed"

# Addresses: node i on 127.0.0.(10+i), every node on the same ports. A port is
# moved up by 1000 for all nodes when something already listens there.
ports=()
for base in 8080 7400 9090 7946; do
	p=$base
	for _ in 1 2 3 4 5; do
		busy=false
		for ((i = 1; i <= nodes; i++)); do
			if port_busy "127.0.0.$((10 + i))" "$p"; then busy=true; break; fi
		done
		$busy || break
		p=$((p + 1000))
	done
	$busy && die "no free port for every node near $base"
	ports+=("$p")
done
http_port=${ports[0]} rpc_port=${ports[1]} admin_port=${ports[2]} gossip_port=${ports[3]}

ip() { echo "127.0.0.$((10 + $1))"; }
join=()
for ((i = 1; i <= nodes; i++)); do join+=("$(ip "$i"):$gossip_port"); done

# start_node I JOIN: start node I in its own session (so a Ctrl-C in the
# terminal reaches only this script, which then stops the nodes in order).
start_node() {
	local i=$1 join_list=$2 a
	a=$(ip "$i")
	mkdir -p "$dir/nodes/q$i"
	setsid "$quotad" serve \
		--node-id "q$i" \
		--data-dir "$dir/nodes/q$i/data" \
		--ledger "$dsn" \
		--http-addr "$a:$http_port" \
		--rpc-addr "$a:$rpc_port" \
		--admin-addr "$a:$admin_port" \
		--gossip-addr "$a:$gossip_port" \
		--join "$join_list" \
		--ring-preset local \
		--drain-timeout "${drain_timeout}s" \
		--settle-timeout "${settle_timeout}s" \
		</dev/null >"$dir/nodes/q$i/quotad.log" 2>&1 &
	echo "q$i $!" >>"$dir/pids"
}

# wait_ready I: until node I's /readyz answers 200, or it exits, or timeout.
wait_ready() {
	local i=$1 pid deadline=$((SECONDS + timeout))
	pid=$(awk -v n="q$i" '$1 == n {print $2}' "$dir/pids")
	until curl -fsS -o /dev/null --max-time 2 "http://$(ip "$i"):$admin_port/readyz" 2>/dev/null; do
		if ! alive "$pid"; then
			echo "--- $dir/nodes/q$i/quotad.log (last 20 lines)" >&2
			tail -n 20 "$dir/nodes/q$i/quotad.log" >&2 || true
			die "node q$i exited before it was ready"
		fi
		if ((SECONDS >= deadline)); then
			echo "--- $dir/nodes/q$i/quotad.log (last 20 lines)" >&2
			tail -n 20 "$dir/nodes/q$i/quotad.log" >&2 || true
			die "node q$i not ready after ${timeout}s"
		fi
		sleep 0.2
	done
}

# The first node founds the ring; the others join every node's gossip address
# (as in Kubernetes, where the headless Service resolves to every pod), and
# start together.
say "starting $nodes node(s) on 127.0.0.11-$(ip "$nodes")"
start_node 1 ""
wait_ready 1
for ((i = 2; i <= nodes; i++)); do
	start_node "$i" "$(IFS=,; echo "${join[*]}")"
done
for ((i = 2; i <= nodes; i++)); do wait_ready "$i"; done

# When the nodes export quotaring_ring_members, also wait until each one sees
# all of them serving (the ring has merged).
members_serving() {
	curl -fsS --max-time 2 "http://$(ip "$1"):$admin_port/metrics" 2>/dev/null |
		awk '$1 ~ /^quotaring_ring_members\{.*state="serving"/ {print $2; found=1} END {if (!found) print "none"}'
}
if [[ $(members_serving 1) != none ]]; then
	deadline=$((SECONDS + timeout))
	for ((i = 1; i <= nodes; i++)); do
		until [[ $(members_serving "$i") == "$nodes" ]]; do
			((SECONDS < deadline)) || die "node q$i does not see $nodes serving members after ${timeout}s"
			sleep 0.2
		done
	done
fi

# For scripts: source DIR/cluster.env.
{
	echo "QUOTARING_DIR=$dir"
	echo "QUOTARING_QUOTAD=$quotad"
	echo "QUOTARING_LEDGER='$dsn'"
	echo "QUOTARING_NODES=$nodes"
	for kind in http rpc admin gossip; do
		port_var=${kind}_port
		list=()
		for ((i = 1; i <= nodes; i++)); do list+=("$(ip "$i"):${!port_var}"); done
		printf 'QUOTARING_%s_ADDRS=%s\n' "${kind^^}" "$(IFS=,; echo "${list[*]}")"
	done
} >"$dir/cluster.env"
started=true

echo
printf '%-5s %-22s %-22s %-22s %-22s %s\n' node http admin rpc gossip log
for ((i = 1; i <= nodes; i++)); do
	a=$(ip "$i")
	printf '%-5s %-22s %-22s %-22s %-22s %s\n' "q$i" "$a:$http_port" "$a:$admin_port" "$a:$rpc_port" "$a:$gossip_port" "$dir/nodes/q$i/quotad.log"
done
echo
echo "ledger:  $dsn"
echo "         (postgres log: $dir/pg/postgres.log)"
echo "metrics: curl http://$(ip 1):$admin_port/metrics"
echo "env:     source $dir/cluster.env"
# Demo data and load: quotad bench cluster creates its plan and accounts in
# the ledger (--setup) and drives the nodes over their RPC port. (cobra
# prints bench's own help for an unknown subcommand, so look in the list.)
rpc_addrs=$(. "$dir/cluster.env" && echo "$QUOTARING_RPC_ADDRS")
bench_help=$("$quotad" bench --help 2>/dev/null || true)
if grep -q '^  cluster ' <<<"$bench_help"; then
	echo "load:    $quotad bench cluster --nodes $rpc_addrs \\"
	echo "             --ledger '$dsn' --setup --accounts 1000 --concurrency 1,8,64 --duration 5s"
else
	echo "load:    this quotad has no 'bench cluster' yet; seed data with the ledger DSN above"
fi
if $detach; then
	echo "stop:    $0 stop --dir $dir"
else
	echo "stop:    Ctrl-C (or: $0 stop --dir $dir)"
fi
echo
echo "cluster ready: $nodes node(s)"

if $detach; then
	trap - EXIT INT TERM
	exit 0
fi

# Foreground: wait for Ctrl-C. A node that exits (say, killed to watch a
# failover) is reported; the others keep running.
trap - EXIT
node_pids=()
while read -r name pid; do
	[[ $name == postgres ]] || node_pids+=("$pid")
done <"$dir/pids"
reported=()
while :; do
	live=()
	for ((i = 1; i <= nodes; i++)); do
		pid=${node_pids[$((i - 1))]}
		if alive "$pid"; then
			live+=("$pid")
		elif [[ -z ${reported[$i]:-} ]]; then
			say "node q$i exited (see $dir/nodes/q$i/quotad.log); the others keep running"
			reported[$i]=1
		fi
	done
	if ((${#live[@]} == 0)); then
		say "every node has exited"
		stop_all
		exit 1
	fi
	# Returns when one of the live nodes exits, or when a signal arrives (the
	# trap then stops everything).
	wait -n "${live[@]}" 2>/dev/null || true
done
