// Package chaos breaks a real quotaring cluster on purpose and checks, from
// what its clients saw and what its ledger holds, that nothing acknowledged
// was lost, nothing was billed twice and no hard limit was overspent.
// `go test ./chaos_test` runs a few short schedules in CI; `quotad chaos`
// runs the same harness for operators.
//
//	rep, err := chaos.Run(ctx, chaos.Config{Nodes: 5, Duration: 10 * time.Minute, Faults: chaos.AllFaults, Seed: 42, Out: "report"})
//	if err != nil { ... }      // the run could not be done (no Postgres, a node that never started)
//	if rep.Violated() { ... }  // report/report.md names the first offending operations
//
// # A run
//
//	build quotad (or use Config.Binary); start Postgres from the local binaries
//	  and a TCP fault proxy in front of it (the nodes' --ledger points at it)
//	seed plans, accounts, API keys and route weights in the ledger
//	start the nodes (internal/cluster: a process each, its own data dir, on
//	  127.x.y.z, --test-faults), wait for one ring and the config everywhere
//	run the workload (workload.go) and, from the same instant, the plan's
//	  faults (nemesis.go); record every operation in a cluster.History
//	heal everything, load for 5 s more, stop the load, wait until every log
//	  is settled, read what every node holds reserved and what the ledger
//	  reserves for it (holds.go), SIGTERM every node (a drained node hands
//	  its reservations back), read every data dir and the ledger
//	run the checkers (internal/cluster/check.go) and write the report
//
// # Faults
//
// The plan (plan.go) is a pure function of the seed, the starting nodes,
// the duration and the fault kinds: testdata/plans.txt pins the plans of
// the CI runs and of the operators' example. Faults of classes that must not
// overlap (one node down at a time, one partition, one ledger fault,
// membership changes alone) never do; others mix. FaultHelp says what each
// does. Partitions go through the nodes' test fault layer (POST /test/block
// on both sides: gossip and RPC are cut at the node's transports), not the
// kernel: this machine's kernel has no tc classifiers and no iptables
// binary, and the README says what a netns version would take.
//
// # Determinism
//
// The seed fixes the schedule and each worker's choices (which account,
// which way in, retries, refunds); the interleavings are the real processes'
// own. A schedule is wall-clock by nature; everything the harness waits for
// in between (a node ready, one ring, settled logs) it polls for, never
// sleeps for.
//
// # Concurrency
//
// Runs at the same time (in one process or several) each take a random
// loopback subnet (Config.Subnet), so their nodes never meet. Inside a run
// one goroutine (the nemesis) owns the cluster, the
// workers read the current members through an atomic pointer, and the
// history and the harness's records have their own mutexes.
package chaos
