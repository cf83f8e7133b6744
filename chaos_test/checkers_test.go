package chaos

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/cluster"
)

// Each checker can fail: a small made-up history and ledger in which every
// guarantee holds, then one fault each (an overshoot, a lost charge, a
// double-billed event, a double refund, a rate-limit excess, a period going
// backwards, ...) that exactly one checker must report, naming the
// operations that show it.

const (
	ms    = int64(time.Millisecond)
	june  = int64(1782864000) // 2026-07-01T00:00:00Z: the end of June 2026
	july  = int64(1785542400) // 2026-08-01T00:00:00Z: the end of July 2026
	grant = "m:2026-06"
)

// world is a history with its ledger, built to hold every guarantee.
type world struct {
	in *cluster.CheckInput
}

func newWorld() *world {
	w := &world{in: &cluster.CheckInput{
		Accounts: map[string]cluster.Limits{
			"hard-1": {Hard: true, Quota: 3},
			"rl-1":   {Quota: 1 << 40, Rate: 1, Burst: 2},
		},
		Ledger: &cluster.LedgerState{Events: map[string][]flush.EventRow{}, Grants: map[string][]flush.GrantRow{}},
	}}
	// hard-1: three charges and a refund against a quota of 3, then a
	// refusal.
	w.charge("hard-1", "e1", 0, "ok")
	w.charge("hard-1", "e2", 10, "ok")
	w.refund("hard-1", "e2", 20, "refunded")
	w.charge("hard-1", "e3", 30, "ok")
	w.charge("hard-1", "e4", 40, "ok")
	w.charge("hard-1", "e5", 50, "quota_exceeded")
	w.refund("hard-1", "e2", 60, "already_refunded")
	w.row("hard-1", "e1", 1, false)
	w.row("hard-1", "e2", 2, true)
	w.row("hard-1", "e3", 3, false)
	w.row("hard-1", "e4", 4, false)
	w.in.Ledger.Grants["hard-1"] = []flush.GrantRow{{Account: "hard-1", Grant: grant, Monthly: true, Units: 3, Used: 3}}
	// rl-1 (1/s, burst 2): a burst of 2, refused, one more a second later.
	w.charge("rl-1", "r1", 0, "ok")
	w.charge("rl-1", "r2", 5, "ok")
	w.charge("rl-1", "r3", 10, "rate_limited")
	w.charge("rl-1", "r4", 1100, "ok")
	for i, e := range []string{"r1", "r2", "r4"} {
		w.row("rl-1", e, uint64(10+i), false)
	}
	w.in.Ledger.Reconcile = []flush.ReconcileRow{{Account: "hard-1", Kind: "grant", Scope: grant, Counter: 3, Events: 3}}
	w.in.Ledger.Nodes = []flush.NodeRow{{Node: "n1", Incarnation: "inc-1", Settled: 20}}
	w.in.Logs = []cluster.LogState{{Node: "n1", Incarnation: "inc-1", Settled: 20, Durable: 20}}
	// Before the drain n1 held 2 units, and the ledger 3 for it: one of a
	// reserve whose commit was cut off, which n1 counts in doubt.
	w.in.Holds = []cluster.NodeHold{{Node: "n1", Held: 2, Uncertain: 1, Ledger: 3}, {Node: "n2"}}
	// The ledger was down from 1.2 s to 3.4 s; a charge went through.
	w.in.LedgerDown = []cluster.Window{{Kind: string(LedgerDown), Start: 1200 * ms, End: 3400 * ms}}
	w.in.Faults = slices.Clone(w.in.LedgerDown)
	w.charge("rl-1", "r5", 2500, "ok")
	w.row("rl-1", "r5", 13, false)
	return w
}

// charge adds a charge of one unit answered reason by n1 at atMs (sent 1 ms
// before).
func (w *world) charge(acct, ev string, atMs int64, reason string) *cluster.Op {
	st := cluster.StatusOK
	if reason != "ok" && reason != "replayed" {
		st = cluster.StatusRefused
	}
	return w.add(cluster.Op{Kind: cluster.OpCharge, Via: "grpc", Node: "n1", Decider: "n1", Account: acct, EventID: ev, Units: 1,
		Start: atMs*ms - ms, End: atMs * ms, Status: st, Reason: reason, Reset: june})
}

func (w *world) refund(acct, ev string, atMs int64, reason string) *cluster.Op {
	st := cluster.StatusOK
	if reason != "refunded" {
		st = cluster.StatusRefused
	}
	return w.add(cluster.Op{Kind: cluster.OpRefund, Via: "client", Node: "client", Decider: "n1", Account: acct, EventID: ev, Units: 1,
		Start: atMs*ms - ms, End: atMs * ms, Status: st, Reason: reason, Reset: june})
}

func (w *world) add(op cluster.Op) *cluster.Op {
	op.ID = len(w.in.Ops)
	w.in.Ops = append(w.in.Ops, op)
	return &w.in.Ops[len(w.in.Ops)-1]
}

func (w *world) row(acct, ev string, seq uint64, refunded bool) {
	w.in.Ledger.Events[acct] = append(w.in.Ledger.Events[acct], flush.EventRow{Account: acct, EventID: ev, Units: 1, Period: "2026-06",
		Node: "n1", Incarnation: "inc-1", Seq: seq, Refunded: refunded})
}

func TestCheckersHoldOnAGoodHistory(t *testing.T) {
	for _, r := range cluster.Check(newWorld().in) {
		if r.Verdict == cluster.Violated {
			t.Errorf("%s violated on a good history: %+v", r.ID, r.Violations)
		}
	}
}

// An event with a row in each of two months, one of them refunded, is
// billed once (seed 7 of the chaos runs: an abandoned attempt charged in the
// wrong month and refunded there, its served retry billed in the right one).
// Both rows billed is G3's violation (TestEachCheckerCanFail).
func TestG3CountsBilledRowsOnly(t *testing.T) {
	w := newWorld()
	w.in.Ledger.Events["hard-1"] = append(w.in.Ledger.Events["hard-1"], flush.EventRow{Account: "hard-1", EventID: "e1", Units: 1,
		Period: "2026-07", Node: "n2", Incarnation: "inc-2", Seq: 1, Refunded: true})
	for _, r := range cluster.Check(w.in) {
		if r.ID == "G3" && r.Verdict == cluster.Violated {
			t.Errorf("G3 violated by a refunded second row: %+v", r.Violations)
		}
	}
}

func TestEachCheckerCanFail(t *testing.T) {
	for _, tc := range []struct {
		name    string
		id      string // the one checker that must fail
		breakIt func(*world)
		want    string // in the violation's detail
		ops     []int  // the offending operations it must name
	}{
		{"overshoot", "G1", func(w *world) {
			w.charge("hard-1", "e6", 70, "ok") // a fourth unit while 3 are billed
			w.row("hard-1", "e6", 5, false)
			w.in.Ledger.Grants["hard-1"][0].Used = 4
			w.in.Ledger.Reconcile[0].Counter, w.in.Ledger.Reconcile[0].Events = 4, 4
		}, "4 units acknowledged at once in 2026-06 against a hard quota of 3", []int{12}},
		{"lost charge", "G2", func(w *world) {
			w.in.Ledger.Events["hard-1"] = slices.DeleteFunc(w.in.Ledger.Events["hard-1"], func(e flush.EventRow) bool { return e.EventID == "e3" })
		}, "acknowledged, but not in the ledger", []int{3}},
		{"double-billed event", "G3", func(w *world) {
			w.in.Ledger.Events["hard-1"] = append(w.in.Ledger.Events["hard-1"], flush.EventRow{Account: "hard-1", EventID: "e1", Units: 1,
				Node: "n1", Incarnation: "inc-1", Seq: 7})
		}, "billed 2 times", []int{0}},
		{"double-billed across generations", "G3", func(w *world) {
			w.in.Ledger.Events["hard-1"] = append(w.in.Ledger.Events["hard-1"], flush.EventRow{Account: "hard-1", EventID: "e1\x1f1", Units: 1,
				Node: "n1", Incarnation: "inc-1", Seq: 7})
		}, "billed under 2 of its generations at once", []int{0}},
		{"refused charge billed", "G3", func(w *world) { w.row("hard-1", "e5", 6, false) }, "every attempt was answered refused", []int{5}},
		{"double refund", "G4", func(w *world) { w.refund("hard-1", "e2", 65, "refunded") }, "2 refunds of one event answered refunded", []int{2, 12}},
		{"served, yet refunded by the front", "G4", func(w *world) {
			// An HTTP attempt timed out (the front refunds it when it finds
			// its client gone); the retry was served; the ledger refunded
			// the event all the same.
			w.add(cluster.Op{Kind: cluster.OpCharge, Via: "http", Node: "n2", Account: "hard-1", EventID: "e3", Units: 1,
				Start: 25 * ms, End: 28 * ms, Status: cluster.StatusUnknown, Reason: "timeout", RefundPending: true})
			w.in.Ledger.Events["hard-1"][2].Refunded = true
		}, "the refund of an abandoned attempt un-billed the attempt that was served", []int{3, 12}},
		{"refund lost", "G4", func(w *world) { w.in.Ledger.Events["hard-1"][1].Refunded = false },
			"answered refunded, but the ledger does not mark the event refunded", []int{2}},
		{"counter differs from the log", "G6", func(w *world) {
			w.in.Ledger.Reconcile = append(w.in.Ledger.Reconcile, flush.ReconcileRow{Account: "hard-1", Kind: "usage", Scope: "2026-06", Counter: 4, Events: 3, Diff: true})
		}, "usage 2026-06: counter 4, event log 3 (+1)", nil},
		{"rate-limit excess", "G7", func(w *world) {
			w.charge("rl-1", "r6", 1105, "ok") // two within 5 ms after the bucket had 1 token
			w.row("rl-1", "r6", 14, false)
		}, "4 admitted in 1.106s (window [-0.001s, 1.105s]) with 0 moves", []int{7, 8, 10, 12}},
		{"no charge while the ledger was down", "G8", func(w *world) {
			w.in.Ops[len(w.in.Ops)-1].Status = cluster.StatusUnknown // r5 was the only one
			w.in.Ops[len(w.in.Ops)-1].Reason = "timeout"
		}, "no charge acknowledged while the ledger was down", nil},
		{"period backwards", "G9", func(w *world) {
			w.in.Ops[3].Reset = july // e3 answered in July...
			w.in.Ops[3].Decider = "n2"
		}, "period went back from 2026-07 (answered by n2 at 0.030s) to 2026-06 (answered by n1 at 0.040s)", []int{3, 4}},
		{"account stuck undecided", "AVAIL", func(w *world) {
			for i := range int64(8) { // every 5 s from 5 s to 40 s
				op := w.charge("hard-1", fmt.Sprintf("u%d", i), 5000+i*5000, "ok")
				op.Status, op.Reason, op.Decider, op.Reset = cluster.StatusUnknown, "quota_unavailable", "", 0
			}
		}, "every charge undecided for 35s, from 4.999s to 40.000s, 35s of it with no fault active", []int{12, 19}},
		{"sequence repeated", "SEQ", func(w *world) { w.in.Ledger.Events["hard-1"][3].Seq = 3 }, "seq 3 holds two events", nil},
		{"sequence not settled", "SEQ", func(w *world) { w.in.Logs[0].Durable = 22 }, "2 records durable but not settled", nil},
		{"stranded reservation", "RES", func(w *world) {
			w.in.Ledger.Reservations = []flush.Reservation{{Node: "n1", Account: "hard-1", Grant: grant, Units: 1}}
		}, "node n1 still holds 1 units of grant m:2026-06", nil},
		{"reservation stranded before the drain", "RES", func(w *world) { w.in.Holds[1].Ledger = 4 },
			"before the drain the ledger reserved 4 units for node n2, which held 0 (0 in doubt): 4 units stranded until it stops", nil},
		{"more stranded than in doubt", "RES", func(w *world) { w.in.Holds[0].Ledger = 5 },
			"before the drain the ledger reserved 5 units for node n1, which held 2 (1 in doubt): 2 units stranded until it stops", nil},
		{"a node holds what the ledger does not reserve", "RES", func(w *world) { w.in.Holds[0].Held = 4 },
			"before the drain node n1 held 4 units and the ledger reserved 3 for it: 1 units no grant backs", nil},
		{"a reservation audit found units stranded during the run", "RES", func(w *world) {
			w.in.Strands = parseStrands("n2", []byte(`{"time":"2026-06-28T12:00:05Z","level":"INFO","msg":"serving"}
{"time":"2026-06-28T12:01:05Z","level":"WARN","msg":"the ledger reserves 3 units for this node on accounts it neither owns nor holds anything of: spendable by nobody","node":"n2","units":3,"accounts":["hard-1 m:2026-06 3"]}
`))
		}, "node n2's reservation audit found 3 units stranded at 2026-06-28T12:01:05Z (account grant units: hard-1 m:2026-06 3)", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld()
			tc.breakIt(w)
			for _, r := range cluster.Check(w.in) {
				if r.ID != tc.id {
					if r.Verdict == cluster.Violated {
						t.Errorf("%s violated too: %+v", r.ID, r.Violations)
					}
					continue
				}
				if r.Verdict != cluster.Violated || len(r.Violations) == 0 {
					t.Fatalf("%s: %s, want violated (%s)", r.ID, r.Verdict, r.Summary)
				}
				v := r.Violations[0]
				if !strings.Contains(v.Detail, tc.want) {
					t.Errorf("%s: %q, want it to say %q", r.ID, v.Detail, tc.want)
				}
				if tc.ops != nil && !slices.Equal(v.Ops, tc.ops) {
					t.Errorf("%s names operations %v, want %v", r.ID, v.Ops, tc.ops)
				}
			}
		})
	}
}

// TestAvailWaitsOutChainedFaults: an account undecided for 40 s is not
// stuck while faults chained back to back held it (a kill, a ledger outage),
// and is once it stays undecided 15 s past the last fault's end.
func TestAvailWaitsOutChainedFaults(t *testing.T) {
	for _, tc := range []struct {
		name   string
		faults []cluster.Window
		want   string // "" for held
	}{
		{"faults throughout, with short gaps", []cluster.Window{
			{Kind: string(Kill), Node: "n1", Start: 4000 * ms, End: 12000 * ms},
			{Kind: string(LedgerDown), Start: 10000 * ms, End: 22000 * ms},
			{Kind: string(DiskLoss), Node: "n2", Start: 30000 * ms, End: 42000 * ms},
		}, ""},
		{"stuck after the faults ended", []cluster.Window{
			{Kind: string(Kill), Node: "n1", Start: 4000 * ms, End: 12000 * ms},
			{Kind: string(LedgerDown), Start: 10000 * ms, End: 22000 * ms},
		}, "every charge undecided for 40s, from 4.999s to 45.000s, 23s of it with no fault active"},
		{"stuck between two faults", []cluster.Window{
			{Kind: string(Kill), Node: "n1", Start: 4000 * ms, End: 8000 * ms},
			{Kind: string(LedgerDown), Start: 26000 * ms, End: 50000 * ms},
		}, "18s of it with no fault active"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld()
			for i := range int64(9) { // every 5 s from 5 s to 45 s
				op := w.charge("hard-1", fmt.Sprintf("u%d", i), 5000+i*5000, "ok")
				op.Status, op.Reason, op.Decider, op.Reset = cluster.StatusUnknown, "quota_unavailable", "", 0
			}
			w.in.Faults = append(w.in.Faults, tc.faults...)
			r := cluster.CheckAvail(w.in)
			switch {
			case tc.want == "" && r.Verdict != cluster.Held:
				t.Fatalf("%s: %+v, want held", r.Verdict, r.Violations)
			case tc.want != "" && (r.Verdict != cluster.Violated || !strings.Contains(r.Violations[0].Detail, tc.want)):
				t.Fatalf("%s %+v, want a violation saying %q", r.Verdict, r.Violations, tc.want)
			}
			t.Log(r.Summary)
		})
	}
}

// A refunded client id charged again is its next generation, billed again
// under its own ledger id (shard.LedgerEventID): not an event billed twice,
// nor one nobody asked for.
func TestGenerationsAreNotDoubleBilling(t *testing.T) {
	w := newWorld()
	w.refund("rl-1", "r4", 3500, "refunded")
	w.charge("rl-1", "r4", 3600, "ok") // after the refund: generation 1
	for i, e := range w.in.Ledger.Events["rl-1"] {
		if e.EventID == "r4" {
			w.in.Ledger.Events["rl-1"][i].Refunded = true
		}
	}
	w.in.Ledger.Events["rl-1"] = append(w.in.Ledger.Events["rl-1"], flush.EventRow{Account: "rl-1", EventID: "r4\x1f1", Units: 1,
		Period: "2026-06", Node: "n1", Incarnation: "inc-1", Seq: 16})
	for _, r := range cluster.Check(w.in) {
		if r.Verdict == cluster.Violated {
			t.Errorf("%s violated: %+v", r.ID, r.Violations)
		}
	}
}

// A destroyed disk's unsettled charges are the documented loss: not a G2
// violation, reported as a number, and an allowance for G1 (the frozen
// reservation they spent was revoked, so those units may be spent again).
func TestLossIsReportedNotViolated(t *testing.T) {
	w := newWorld()
	w.in.Ledger.Events["hard-1"] = slices.DeleteFunc(w.in.Ledger.Events["hard-1"], func(e flush.EventRow) bool { return e.EventID == "e3" })
	w.in.Lost = []cluster.LostCharge{{Node: "n1", Incarnation: "inc-0", Seq: 9, Account: "hard-1", EventID: "e3", Units: 1, Reset: june}}
	w.in.Ledger.Nodes = append(w.in.Ledger.Nodes, flush.NodeRow{Node: "n1", Incarnation: "inc-0", Settled: 8})
	w.charge("hard-1", "e7", 70, "ok") // spends the unit e3's loss freed
	w.row("hard-1", "e7", 5, false)
	for _, r := range cluster.Check(w.in) {
		if r.Verdict == cluster.Violated {
			t.Errorf("%s violated: %+v", r.ID, r.Violations)
		}
		if r.ID == "G2" && !strings.Contains(r.Summary, "documented loss (destroyed disks): 1 charges, 1 units") {
			t.Errorf("G2 does not report the loss: %s", r.Summary)
		}
	}
}

// Two ledger outages back to back (the second fault stopped Postgres as
// the first one's restart finished) were one outage to the nodes: G8
// reports one, and says so.
func TestG8JoinsOutagesBackToBack(t *testing.T) {
	w := newWorld()
	w.in.LedgerDown = []cluster.Window{
		{Kind: string(LedgerDown), Start: 1200 * ms, End: 2000 * ms},
		{Kind: string(LedgerDown), Start: 2000 * ms, End: 3400 * ms},
	}
	r := cluster.CheckG8(w.in)
	if r.Verdict != cluster.Held || !strings.Contains(r.Summary, "1 charges in the 2.2s outage at") || !strings.Contains(r.Summary, "(faults back to back)") {
		t.Fatalf("G8: %s %q; want one 2.2 s outage, said to be two faults back to back", r.Verdict, r.Summary)
	}
}

// A node killed between a settle's commit in the ledger and its own mark
// leaves settled records unsettled in its dir: measured from the dir they
// look lost, but the ledger's mark covers them. They are not counted as
// loss (G1 gets no allowance for them, G2 reports none), and SEQ holds
// while the ledger has their rows and flags a mark that covers a row it
// does not hold.
func TestLossTheLedgerSettledIsNotLoss(t *testing.T) {
	w := newWorld()
	w.in.Lost = []cluster.LostCharge{{Node: "n1", Incarnation: "inc-0", Seq: 9, Account: "hard-1", EventID: "e3", Units: 1, Reset: june}}
	w.in.Ledger.Nodes = append(w.in.Ledger.Nodes, flush.NodeRow{Node: "n1", Incarnation: "inc-0", Settled: 9})
	for _, r := range cluster.Check(w.in) {
		if r.Verdict == cluster.Violated {
			t.Errorf("%s violated: %+v", r.ID, r.Violations)
		}
		if r.ID == "G2" && !strings.Contains(r.Summary, "documented loss (destroyed disks): 0 charges, 0 units") {
			t.Errorf("G2 counts a settled record as lost: %s", r.Summary)
		}
		if r.ID == "SEQ" && !strings.Contains(r.Summary, "1 records unsettled on lost disks were in the ledger") {
			t.Errorf("SEQ does not say a measured loss was settled: %s", r.Summary)
		}
	}
	w.in.Ledger.Events["hard-1"] = slices.DeleteFunc(w.in.Ledger.Events["hard-1"], func(e flush.EventRow) bool { return e.EventID == "e3" })
	r := cluster.CheckSeq(w.in)
	if r.Verdict != cluster.Violated || !strings.Contains(fmt.Sprint(r.Violations), "the ledger holds no row of the event") {
		t.Errorf("SEQ with a mark covering a missing row: %s %+v; want the row missing flagged", r.Verdict, r.Violations)
	}
}

// --out loses an earlier run's report files at the start of a run: a run
// that then ended without a report (a setup error, an early Ctrl-C) left
// the earlier "every invariant held" in place. Other files stay.
func TestOutDropsTheEarlierReport(t *testing.T) {
	out := t.TempDir()
	for _, name := range append(reportFiles(), "notes.txt") {
		if err := os.WriteFile(filepath.Join(out, name), []byte("earlier"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	c := &Config{Out: out}
	if err := c.checkDirs(); err != nil {
		t.Fatal(err)
	}
	for _, name := range reportFiles() {
		if _, err := os.Stat(filepath.Join(out, name)); !os.IsNotExist(err) {
			t.Errorf("%s of the earlier run is still in --out (%v)", name, err)
		}
	}
	if _, err := os.Stat(filepath.Join(out, "notes.txt")); err != nil {
		t.Errorf("a file of the operator's own was removed: %v", err)
	}
}
