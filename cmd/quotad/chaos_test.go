package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/quotaring/quotaring/internal/cluster"
)

// Bad flags are refused before anything starts. A zero is not "the
// default": chaos.Config reads zero that way, so --nodes 0 ran five nodes
// for ten minutes and --duration 0 the whole ten minutes.
func TestChaosFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--nodes", "0"}, "--nodes 0: want at least 3"},
		{[]string{"--nodes", "2"}, "--nodes 2: want at least 3"},
		{[]string{"--duration", "0"}, "--duration 0s"},
		{[]string{"--duration", "1ms"}, "at least 15s"},
		{[]string{"--duration", "10s"}, "--duration 10s: want at least 15s"},
		{[]string{"--nodes", "300"}, "--nodes 300: want at most 151 with --first-ip 100"},
		{[]string{"--first-ip", "250"}, "--nodes 5: want at most 1 with --first-ip 250"},
		{[]string{"--workers", "0"}, "--workers 0"},
		{[]string{"--rate", "0"}, "--rate 0"},
		{[]string{"--rate", "NaN"}, "--rate NaN: want 0.5 to 100000"}, // it panicked once the cluster ran
		{[]string{"--rate", "Inf"}, "--rate +Inf"},
		{[]string{"--rate", "2e9"}, "--rate 2e+09"},
		{[]string{"--rate", "1e-9"}, "--rate 1e-09"}, // a run that tests nothing
		{[]string{"--first-ip", "300"}, "--first-ip 300: want 2 to 250"},
		{[]string{"--settle-interval", "0"}, "--settle-interval 0s"},
		{[]string{"--settle-interval", "1ms"}, "--settle-interval 1ms: want at least 10ms"}, // the nodes refused it, after Postgres started
		{[]string{"--nodes", "3", "--faults", "scale-down"}, "no fault of --faults scale-down fits this run"},
		// A run that would pass without some of the faults asked for.
		{[]string{"--nodes", "3", "--duration", "45s", "--faults", "kill,pause,ledger-down,isolate,disk-loss", "--seed", "5"},
			"has no episode of ledger-down,disk-loss, so the run would pass without trying them: no room in 45s"},
		{[]string{"--nodes", "4", "--duration", "1m", "--faults", "all", "--seed", "5"}, "or more (for this seed), or leave them out of --faults"},
		{[]string{"--first-ip", "0"}, "--first-ip 0"},
		{[]string{"--faults", "crashes"}, `unknown fault "crashes"`},
		{[]string{"--faults", ","}, "no faults given"},
	} {
		var out bytes.Buffer
		root := newRootCmd()
		root.SetArgs(append([]string{"chaos", "--binary", "/nonexistent/quotad"}, tc.args...))
		root.SetOut(&out)
		root.SetErr(&out)
		err := root.ExecuteContext(context.Background())
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("quotad chaos %s: %v, want an error with %q", strings.Join(tc.args, " "), err, tc.want)
		}
		if strings.Contains(out.String(), "starting") {
			t.Errorf("quotad chaos %s started a cluster:\n%s", strings.Join(tc.args, " "), out.String())
		}
	}
	dir := t.TempDir()
	// A refused run leaves the earlier run's report in --out: it is
	// removed when a run starts, and this one never did.
	out := filepath.Join(dir, "out")
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(out, "report.md"), []byte("earlier\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := runQuotad(t, "chaos", "--binary", filepath.Join(dir, "nope"), "--dir", filepath.Join(dir, "run"), "--out", out); err == nil || !strings.Contains(err.Error(), "--binary") {
		t.Errorf("quotad chaos with a missing --binary and --out: %v, want --binary named", err)
	}
	if b, err := os.ReadFile(filepath.Join(out, "report.md")); err != nil || string(b) != "earlier\n" {
		t.Errorf("a run refused for its --binary removed the earlier report.md: %q %v", b, err)
	}
	if _, err := runQuotad(t, "chaos", "--binary", filepath.Join(dir, "nope"), "--dir", filepath.Join(dir, "run")); err == nil || !strings.Contains(err.Error(), "--binary") {
		t.Errorf("quotad chaos with a missing --binary: %v, want it named before anything starts", err)
	}
	if ents, err := os.ReadDir(filepath.Join(dir, "run")); len(ents) > 0 || err != nil && !os.IsNotExist(err) {
		t.Errorf("quotad chaos with a missing --binary left --dir in use: %v, %v", ents, err)
	}
}

// --help names every check a run reports (ALERT was missing) and what
// the exit codes mean.
func TestChaosHelpNamesEveryCheck(t *testing.T) {
	var out bytes.Buffer
	root := newRootCmd()
	root.SetArgs([]string{"chaos", "--help"})
	root.SetOut(&out)
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	ids := []string{"ALERT", "LIVE"} // the harness's own, beside the checkers
	for _, c := range cluster.Checkers {
		ids = append(ids, c.ID)
	}
	for _, id := range ids {
		if !regexp.MustCompile(`(?m)^  ` + id + `\s`).MatchString(out.String()) {
			t.Errorf("quotad chaos --help does not list the check %s", id)
		}
	}
	for _, s := range []string{"Exits 0", "3 on a violation", "130 when", "--seed", "--out"} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("quotad chaos --help does not say %q", s)
		}
	}
}
