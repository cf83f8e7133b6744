package chaos

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the golden files under testdata/ instead of comparing")

// goldenPlans are the plans testdata/plans.txt pins: the CI runs and the
// operators' example. A change to how plans are drawn shows up as a diff of
// that file (go test ./chaos_test -run Plans -rewrite), to review like code.
func goldenPlans(t *testing.T) []*Plan {
	var out []*Plan
	for _, r := range append(slices.Clone(ciRuns), knownViolations...) {
		out = append(out, mustPlan(t, r.seed, r.nodes, r.duration, r.faults))
	}
	return append(out, mustPlan(t, 1, 5, 10*time.Minute, "all"))
}

func mustPlan(t *testing.T, seed uint64, nodes int, d time.Duration, faults string) *Plan {
	t.Helper()
	fs, err := ParseFaults(faults)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewPlan(seed, nodes, d, fs)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// Every CI plan has every fault it names, and together with the known
// violations' plans they have every fault there is.
func TestCIPlansCoverTheirFaults(t *testing.T) {
	all := map[Fault]bool{}
	for _, r := range append(slices.Clone(ciRuns), knownViolations...) {
		p := mustPlan(t, r.seed, r.nodes, r.duration, r.faults)
		for _, f := range p.Faults {
			if !slices.ContainsFunc(p.Episodes, func(e Episode) bool { return e.Fault == f }) {
				t.Errorf("%s: the plan never has %s:\n%s", r.name, f, p)
			}
			all[f] = true
		}
	}
	for _, f := range AllFaults {
		if !all[f] {
			t.Errorf("no CI run has %s", f)
		}
	}
}

func TestPlansGolden(t *testing.T) {
	var b strings.Builder
	for _, p := range goldenPlans(t) {
		b.WriteString(p.String())
		b.WriteString("\n")
	}
	golden(t, "plans.txt", b.String())
}

// golden compares got with testdata/name, or rewrites it with -rewrite.
func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *rewrite {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -rewrite to create it)", err)
	}
	if string(want) != got {
		t.Fatalf("%s differs from what the code makes now (review, then -rewrite):\n--- want\n%s\n--- got\n%s", path, want, got)
	}
}

// Every plan is the same for the same seed, keeps within its duration,
// never overlaps faults that must not mix, and never targets a node that
// is not in the cluster at that time.
func TestPlansAreWellFormed(t *testing.T) {
	for seed := uint64(0); seed < 200; seed++ {
		nodes := 3 + int(seed%4)
		p := mustPlan(t, seed, nodes, 3*time.Minute, "all")
		if q := mustPlan(t, seed, nodes, 3*time.Minute, "all"); q.String() != p.String() {
			t.Fatalf("seed %d: two plans differ:\n%s\n%s", seed, p, q)
		}
		members := map[string]bool{}
		for i := 1; i <= nodes; i++ {
			members[fmt.Sprintf("n%d", i)] = true
		}
		for i, e := range p.Episodes {
			if e.End > p.Duration || e.End < e.Start {
				t.Fatalf("seed %d: episode %d [%s, %s] outside the run's %s", seed, i, e.Start, e.End, p.Duration)
			}
			for _, o := range p.Episodes[:i] {
				if o.End > e.Start && !compatible(e.Fault.class(), o.Fault.class()) {
					t.Fatalf("seed %d: %s overlaps %s:\n%s", seed, e.Describe(), o.Describe(), p)
				}
				if o.End > e.Start && e.Node != "" && e.Node == o.Node && e.Fault.class() != "network" && o.Fault.class() != "network" {
					t.Fatalf("seed %d: %s and %s on one node at once:\n%s", seed, e.Describe(), o.Describe(), p)
				}
			}
			if e.Fault == ScaleUp {
				if members[e.Node] {
					t.Fatalf("seed %d: %s adds a node already there:\n%s", seed, e.Describe(), p)
				}
				members[e.Node] = true
			}
			for _, n := range append(append([]string{e.Node}, e.Sides[0]...), e.Sides[1]...) {
				if n != "" && !members[n] {
					t.Fatalf("seed %d: %s targets %s, not in the cluster then:\n%s", seed, e.Describe(), n, p)
				}
			}
			if e.Fault == ScaleDown {
				delete(members, e.Node)
			}
			if e.Fault.class() == "network" {
				n := len(e.Sides[0]) + len(e.Sides[1])
				if e.Fault == Bridge {
					n++
				}
				if len(e.Sides[0]) == 0 || len(e.Sides[1]) == 0 || n != len(members) {
					t.Fatalf("seed %d: %s does not cut the %d nodes in two non-empty sides", seed, e.Describe(), len(members))
				}
			}
		}
	}
}

// A fault given that the duration leaves no room for is named in the
// plan (printed at the start and in the report), not silently dropped:
// --duration 15s --faults kill,split,ledger-down ran one split and
// nothing else, and said nothing.
func TestPlanNamesTheFaultsItHasNoRoomFor(t *testing.T) {
	p := mustPlan(t, 1, 3, 15*time.Second, "kill,split,ledger-down")
	if m := p.Missing(); !slices.Equal(m, []Fault{Kill, LedgerDown}) {
		t.Fatalf("missing %v, want [kill ledger-down]:\n%s", m, p)
	}
	if !strings.Contains(p.String(), "NOT IN THE PLAN: no room in 15s: kill,ledger-down") {
		t.Fatalf("the plan does not say which faults it has no room for:\n%s", p)
	}
	// scale-down never takes 3 nodes below 3: that is what the plan says,
	// not that a longer --duration would fit it.
	p = mustPlan(t, 1, 3, 10*time.Minute, "scale-down")
	if len(p.Episodes) != 0 || !strings.Contains(p.String(), "scale-down (it never takes the cluster below 3 nodes: give --nodes 4 or more)") {
		t.Fatalf("scale-down on 3 nodes:\n%s", p)
	}
	for _, g := range goldenPlans(t) {
		if m := g.Missing(); len(m) > 0 || strings.Contains(g.String(), "NOT IN THE PLAN") {
			t.Errorf("golden plan seed %d misses %v:\n%s", g.Seed, m, g)
		}
	}
}

// A plan without some of the faults asked for is refused by Run (it would
// pass without trying them), naming a duration that fits them; with every
// fault asked for, scale-down on 3 nodes is expected missing.
func TestUnplanned(t *testing.T) {
	for _, seed := range []uint64{1, 5, 87, 91} {
		if p := mustPlan(t, seed, 3, 10*time.Minute, "all"); len(p.Unplanned()) > 0 {
			t.Errorf("seed %d, 3 nodes, all, 10m: unplanned %v, want none (scale-down is expected missing)", seed, p.Unplanned())
		}
	}
	p := mustPlan(t, 5, 3, 45*time.Second, "kill,pause,ledger-down,isolate,disk-loss")
	if m := p.Unplanned(); len(m) == 0 {
		t.Fatalf("45 s with five faults: nothing unplanned:\n%s", p)
	}
	d := p.FittingDuration()
	if d == 0 {
		t.Fatal("no duration fits the five faults")
	}
	if q := mustPlan(t, 5, 3, d, "kill,pause,ledger-down,isolate,disk-loss"); len(q.Unplanned()) > 0 {
		t.Errorf("FittingDuration %s does not fit: %v", d, q.Unplanned())
	}
	if q := mustPlan(t, 5, 3, d-15*time.Second, "kill,pause,ledger-down,isolate,disk-loss"); len(q.Unplanned()) == 0 && d-15*time.Second > p.Duration {
		t.Errorf("FittingDuration %s is not the shortest: %s fits too", d, d-15*time.Second)
	}
}
