package chaos

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/cluster"
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
			cfg.Nodes, cfg.Duration, cfg.Faults, cfg.Binary, cfg.Progress = 3, 20*time.Second, []Fault{Kill}, "/nonexistent/quotad", &progress
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
