package chaos

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/cluster"
	"github.com/quotaring/quotaring/internal/pgtest"
)

// binary is the quotad built once for this package's runs (TestMain).
var binary string

func TestMain(m *testing.M) { os.Exit(cluster.Main(m, &binary)) }

type chaosRun struct {
	name     string
	nodes    int
	duration time.Duration
	faults   string
	seed     uint64
}

// ciRuns are the schedules CI runs: each a real cluster, a real Postgres
// and a fixed seed, about 90 s apiece on a 2-core machine. Their plans are
// pinned in testdata/plans.txt. Together they cover every fault.
var ciRuns = []chaosRun{
	{"crashes", 3, 60 * time.Second, "kill,disk-loss,ledger-down", 11},
	{"partitions", 4, 60 * time.Second, "isolate,split,bridge,ledger-slow", 12},
	{"clocks-and-membership", 3, 60 * time.Second, "clock-skew,rolling-restart,scale-up,scale-down", 13},
	// A paused node wakes up as a stale owner and decides requests whose
	// clients retried elsewhere meanwhile (this schedule found the G4 bugs
	// the README's chaos section lists as fixed).
	{"pauses", 3, 60 * time.Second, "pause,kill", 21},
	// Accounts another owner charged while theirs was down, then handed
	// back: this schedule found a month used up with no 100 % alert (the
	// owner never decided past what it had seen) and an explicitly
	// refunded event billed by a retry that settled after the refund.
	{"handbacks", 3, 60 * time.Second, "kill,disk-loss,ledger-down", 3},
	// A node whose clock jumped into the next month billed its accounts
	// there, and a soft account moved off it was answered from this month
	// again (G9); the node now holds to its time from before the jump
	// (engine.SteadyClock), and every answer is in this month. A node
	// restarted with its clock in the next month takes the ledger's time,
	// which the others agree with, before it takes an account.
	{"clocks", 3, 60 * time.Second, "clock-jump,clock-start,rolling-restart,scale-up", 22},
}

// knownViolations reproduce violations the harness found in quotaring that
// are not fixed yet (see the README's chaos section). They run only with
// QUOTARING_CHAOS_KNOWN=1 and fail until the bug is fixed; then move the
// run into ciRuns. None is open: the last, clock-jump, moved on 2026-12-02
// (into the clocks run).
var knownViolations = []chaosRun{}

// TestChaos runs each CI schedule and fails on any violation, printing the
// report (the table, the first offending operations, the faults as they
// were applied and the seed to run it again).
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos runs take about a minute each; not with -short")
	}
	pgtest.RequireBinaries(t)
	runAll(t, ciRuns)
}

// TestKnownViolations reproduces the open violations (knownViolations).
func TestKnownViolations(t *testing.T) {
	if os.Getenv("QUOTARING_CHAOS_KNOWN") != "1" {
		t.Skip("reproductions of open bugs, which fail until they are fixed: set QUOTARING_CHAOS_KNOWN=1 to run them")
	}
	if len(knownViolations) == 0 {
		t.Skip("no open violation to reproduce: knownViolations is empty")
	}
	pgtest.RequireBinaries(t)
	runAll(t, knownViolations)
}

func runAll(t *testing.T, runs []chaosRun) {
	for _, r := range runs {
		t.Run(r.name, func(t *testing.T) {
			faults, err := ParseFaults(r.faults)
			if err != nil {
				t.Fatal(err)
			}
			// QUOTARING_CHAOS_OUT=DIR keeps each run's report and the nodes'
			// data dirs and logs under DIR/<run>.
			out, work := t.TempDir(), t.TempDir()
			if dir := os.Getenv("QUOTARING_CHAOS_OUT"); dir != "" {
				out, work = filepath.Join(dir, r.name), filepath.Join(dir, r.name, "work")
				os.RemoveAll(out)
				if err := os.MkdirAll(work, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			rep, err := Run(ctx, Config{Nodes: r.nodes, Duration: r.duration, Faults: faults, Seed: r.seed, Binary: binary,
				Dir: work, Out: out, Workers: 8, Rate: 100, Progress: testWriter{t}})
			if err != nil {
				t.Fatalf("seed %d: the run could not be done: %v", r.seed, err)
			}
			t.Logf("seed %d, %d operations, loss %+v:\n%s", r.seed, rep.Workload.Ops, rep.Loss, rep.Table())
			// A kept dir (here, one the run was given) holds the ledger's
			// dump, so that a violation can be read in the ledger's rows.
			if dump, err := os.ReadFile(filepath.Join(work, "ledger.sql")); err != nil || !strings.Contains(string(dump), "CREATE TABLE public.events") {
				t.Errorf("seed %d: no ledger dump with the events table in the kept dir (%v)", r.seed, err)
			}
			if rep.Violated() {
				t.Fatalf("seed %d: violations (report in %s):\n%s", r.seed, out, rep.Markdown())
			}
		})
	}
}

// testWriter sends progress lines to t.Log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
