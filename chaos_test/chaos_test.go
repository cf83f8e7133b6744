package chaos

import (
	"context"
	"fmt"
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

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "quotad-chaos-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary, err = cluster.Build(context.Background(), dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := pgtest.Main(m)
	os.RemoveAll(dir)
	os.Exit(code)
}

// ciRuns are the schedules CI runs: each a real cluster, a real Postgres
// and a fixed seed, about 75 s apiece on a 2-core machine. Their plans are
// pinned in testdata/plans.txt. Together they cover every fault.
var ciRuns = []struct {
	name     string
	nodes    int
	duration time.Duration
	faults   string
	seed     uint64
}{
	{"crashes", 3, 60 * time.Second, "kill,disk-loss,pause,ledger-down", 11},
	{"partitions", 4, 60 * time.Second, "isolate,split,bridge,ledger-slow", 12},
	{"clocks-and-membership", 3, 60 * time.Second, "clock-skew,clock-jump,rolling-restart,scale-up,scale-down", 13},
}

// TestChaos runs each CI schedule and fails on any violation, printing the
// report (the table, the first offending operations, the faults as they
// were applied and the seed to run it again).
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos runs take about a minute each; not with -short")
	}
	pgtest.RequireBinaries(t)
	for _, r := range ciRuns {
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
