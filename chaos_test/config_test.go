package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/cluster"
	"github.com/quotaring/quotaring/internal/pgtest"
)

// A --dir that holds anything and an --out that cannot be written are
// refused before Postgres or a node starts. A reused --dir made the nodes
// open an earlier run's data dirs, and the checks reported violations of
// G2, G4, SEQ, RES and LIVE the code under test never made; an --out that
// is a file was found after the whole run, and the report was lost.
func TestRunChecksItsDirsFirst(t *testing.T) {
	used := t.TempDir()
	if err := os.MkdirAll(filepath.Join(used, "nodes", "n1"), 0o755); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "report")
	if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	readOnly := filepath.Join(t.TempDir(), "ro")
	if err := os.Mkdir(readOnly, 0o555); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		cfg  Config
		want string
	}{
		{"dir not empty", Config{Dir: used}, "--dir " + used + " is not empty"},
		{"out is a file", Config{Out: file}, "--out"},
		{"out under a file", Config{Out: filepath.Join(file, "sub")}, "--out"},
	}
	if os.Geteuid() != 0 { // root writes anywhere
		cases = append(cases, struct {
			name string
			cfg  Config
			want string
		}{"out read-only", Config{Out: readOnly}, "could not be written"})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var progress bytes.Buffer
			cfg := tc.cfg
			// NB: an executable --binary (this test's own): since a refused
			// run keeps the earlier report, --binary is checked before the
			// dirs, and a missing one was refused first.
			cfg.Nodes, cfg.Duration, cfg.Faults, cfg.Binary, cfg.Progress = 3, 20*time.Second, []Fault{Kill}, os.Args[0], &progress
			rep, err := Run(context.Background(), cfg)
			if err == nil || rep != nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Run: %v, %v; want no report and an error with %q", rep, err, tc.want)
			}
			if strings.Contains(progress.String(), "starting") {
				t.Fatalf("Run started the cluster before refusing its dirs:\n%s", progress.String())
			}
		})
	}
	if ents, _ := os.ReadDir(filepath.Join(used, "nodes")); len(ents) != 1 {
		t.Fatalf("the refused --dir was changed: %v", ents)
	}
}

// A temporary dir of data dirs and node logs is removed at the end of a
// run that held, and kept, with its path in the log and the report, when
// the run found a violation or failed: the node logs are what a violation
// is traced in, and they were removed with everything else.
func TestWorkDirKeptAfterAViolation(t *testing.T) {
	for _, tc := range []struct {
		why  string
		keep bool
	}{{"", false}, {"invariants violated", true}, {"the run failed", true}} {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "n1.log"), []byte("log"), 0o644); err != nil {
			t.Fatal(err)
		}
		var progress bytes.Buffer
		h := &harness{dir: dir, conns: &cluster.Conns{}, keepWhy: tc.why,
			logf: func(format string, args ...any) { fmt.Fprintf(&progress, format+"\n", args...) }}
		kept := h.keptDir()
		h.close()
		_, err := os.Stat(filepath.Join(dir, "n1.log"))
		if got := err == nil; got != tc.keep || (kept != "") != tc.keep {
			t.Errorf("keepWhy %q: the node log kept %v (report names %q), want %v", tc.why, got, kept, tc.keep)
		}
		if tc.keep && !strings.Contains(progress.String(), dir) {
			t.Errorf("keepWhy %q: the log does not say where the node logs are:\n%s", tc.why, progress.String())
		}
	}
	r := &Report{Results: []cluster.Result{{ID: "G2", Verdict: cluster.Violated, Count: 1}}, Dir: "/tmp/quotaring-chaos-1"}
	if md := r.Markdown(); !strings.Contains(md, "/tmp/quotaring-chaos-1/nodes") || !strings.Contains(md, "What to do") {
		t.Errorf("a violated report does not say where the node logs are and what to do:\n%s", md)
	}
}

// progressCancel cancels a run once a progress line matches at (by
// default, once one counts an operation).
type progressCancel struct {
	cancel context.CancelFunc
	at     *regexp.Regexp
	mu     sync.Mutex
	lines  strings.Builder
}

var someOps = regexp.MustCompile(`\s[1-9][0-9]* ops \(`)

func (p *progressCancel) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lines.Write(b)
	at := p.at
	if at == nil {
		at = someOps
	}
	if at.Match(b) {
		p.cancel()
	}
	return len(b), nil
}

func (p *progressCancel) String() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.lines.String()
}

// An interrupted run (Ctrl-C: its context ends) stops everything it
// started and keeps what it recorded: the operations and faults so far in
// Out, marked as not checked, and the nodes' data dirs and logs. It said
// only "context canceled", wrote nothing, and removed the node logs. Here
// the interrupt comes during a kill: the fault still on is in the faults
// as applied, up to the interrupt (it was left out), and the report gives
// the time of the interrupt, not the time the load had stopped by.
func TestInterruptKeepsWhatWasRecorded(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster")
	}
	pgtest.RequireBinaries(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	progress := &progressCancel{cancel: cancel, at: regexp.MustCompile(`begin kill`)}
	out := t.TempDir()
	rep, err := Run(ctx, Config{Nodes: 3, Duration: 20 * time.Second, Faults: []Fault{Kill}, Seed: 1, Binary: binary,
		Out: out, Workers: 4, Rate: 50, Progress: progress, ProgressEvery: 100 * time.Millisecond})
	if rep != nil && rep.Dir != "" {
		t.Cleanup(func() { os.RemoveAll(rep.Dir) })
	}
	t.Logf("progress:\n%s", progress)
	if !errors.Is(err, context.Canceled) || rep == nil {
		t.Fatalf("Run: %v, %v; want a partial report and an error that wraps context.Canceled", rep, err)
	}
	if rep.Interrupted == "" || len(rep.Results) != 0 || rep.Violated() || rep.Workload.Ops == 0 {
		t.Fatalf("report: interrupted %q, %d results, %d operations; want it marked interrupted, no results, the operations so far",
			rep.Interrupted, len(rep.Results), rep.Workload.Ops)
	}
	md, err := os.ReadFile(filepath.Join(out, "report.md"))
	if err != nil || !strings.Contains(string(md), "INTERRUPTED") {
		t.Fatalf("report.md (%v) does not say the run was interrupted:\n%s", err, md)
	}
	var ops []json.RawMessage
	if b, err := os.ReadFile(filepath.Join(out, "history.json")); err != nil || json.Unmarshal(b, &ops) != nil || len(ops) != rep.Workload.Ops {
		t.Fatalf("history.json: %d operations (%v), want %d", len(ops), err, rep.Workload.Ops)
	}
	if rep.Dir == "" {
		t.Fatal("the report names no data dirs and logs")
	}
	if _, err := os.Stat(filepath.Join(rep.Dir, "nodes", "n1.log")); err != nil {
		t.Fatalf("the node logs were not kept: %v", err)
	}
	if !strings.Contains(progress.String(), "interrupted: stopping") || !strings.Contains(progress.String(), rep.Dir) {
		t.Fatalf("the progress lines do not say the run stops and where the node logs are:\n%s", progress)
	}
	said := regexp.MustCompile(`chaos: (\S+) interrupted: stopping`).FindStringSubmatch(progress.String())
	if said == nil || !strings.HasPrefix(rep.Interrupted, "interrupted at "+said[1]+" ") {
		t.Errorf("report: %q, want the time the progress line gave the interrupt (%v)", rep.Interrupted, said)
	}
	if !slices.ContainsFunc(rep.Applied, func(w cluster.Window) bool { return w.Kind == string(Kill) && w.End > w.Start }) {
		t.Errorf("the faults as applied %+v hold no kill, though one was on at the interrupt", rep.Applied)
	}
}

// The report's command runs the same plan and the same workload again:
// the seed fixes the clients' choices only with the same workers and rate
// (the hard quotas are sized from the rate), so the CI runs' reports (8
// workers, 100/s) named a command that ran another workload.
func TestReportCommandReproducesTheWorkload(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Nodes: 3, Duration: time.Minute, Faults: []Fault{Kill, LedgerDown}, Seed: 11},
			"quotad chaos --nodes 3 --duration 1m0s --faults kill,ledger-down --seed 11"},
		{Config{Seed: 7},
			"quotad chaos --nodes 5 --duration 10m0s --faults all --seed 7"},
		{Config{Nodes: 3, Duration: time.Minute, Faults: []Fault{Pause}, Seed: 21, Workers: 8, Rate: 100},
			"quotad chaos --nodes 3 --duration 1m0s --faults pause --seed 21 --workers 8 --rate 100"},
		{Config{Nodes: 4, Duration: time.Minute, Faults: []Fault{Split}, Seed: 2, Rate: 62.5, SettleInterval: time.Second},
			"quotad chaos --nodes 4 --duration 1m0s --faults split --seed 2 --rate 62.5 --settle-interval 1s"},
	} {
		cfg := tc.cfg
		if err := cfg.defaults(); err != nil {
			t.Fatal(err)
		}
		if got := cfg.command(); got != tc.want {
			t.Errorf("command:\n got %s\nwant %s", got, tc.want)
		}
	}
}

// After the load stops, the waits (settle, alerts, drain) say every
// ProgressEvery what they wait for; they were silent for up to 90 s.
func TestPhaseProgress(t *testing.T) {
	var mu sync.Mutex
	var lines []string
	h := &harness{cfg: Config{ProgressEvery: 10 * time.Millisecond}, hist: cluster.NewHistory()}
	h.logf = func(format string, args ...any) {
		mu.Lock()
		lines = append(lines, fmt.Sprintf(format, args...))
		mu.Unlock()
	}
	count := func() int { mu.Lock(); defer mu.Unlock(); return len(lines) }
	done := h.phase("waiting for every log to settle")
	deadline := time.Now().Add(10 * time.Second)
	for count() < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond) // a poll with a deadline, not a wait for time to pass
	}
	done()
	n := count()
	if n < 2 || !strings.Contains(lines[0], "still waiting for every log to settle (") {
		t.Fatalf("progress lines %q, want two or more naming the wait", lines)
	}
	// done waits for the goroutine: nothing is logged after it.
	if count() != n {
		t.Fatalf("a line after done: %q", lines)
	}
}

// A run is refused before it starts where its disk has less free space
// than it needs (100 nodes kept 6.9 GB); --dir need not exist yet.
func TestCheckDisk(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "not", "yet")
	if err := (&Config{Nodes: 3, Dir: dir}).checkDisk(); err != nil {
		t.Fatalf("3 nodes: %v", err)
	}
	err := (&Config{Nodes: 100_000_000, Dir: dir}).checkDisk()
	if err == nil || !strings.Contains(err.Error(), "a run of 100000000 nodes needs about") || !strings.Contains(err.Error(), filepath.Dir(filepath.Dir(dir))) {
		t.Fatalf("a run no disk holds: %v, want it refused naming the dir", err)
	}
}
