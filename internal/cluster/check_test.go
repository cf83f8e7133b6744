package cluster

import (
	"testing"

	"github.com/quotaring/quotaring/flush"
)

// The owner takes back a charge whose caller gave up while its record
// waited for the disk (engine.Charge): the ledger then marks that attempt
// refunded with no refund asked for, and a retry bills the event again.
// G4 read that as a refund nobody asked for (chaos seed 21, a paused
// owner); it holds when an attempt's outcome was unknown, and still fails
// when none was, or when the retry that was served ends up refunded too.
func TestG4AllowsTheOwnersTakeBack(t *testing.T) {
	ops := func(first Status) []Op {
		return []Op{
			{ID: 495, Kind: OpCharge, Account: "rl-003", EventID: "w7-57", Units: 1, Status: first, Reason: "timeout"},
			{ID: 508, Kind: OpCharge, Account: "rl-003", EventID: "w7-57", Units: 1, Status: StatusOK, Reason: "ok", Decider: "n3"},
		}
	}
	ledger := func(retryRefunded bool) *LedgerState {
		return &LedgerState{Events: map[string][]flush.EventRow{"rl-003": {
			{Account: "rl-003", EventID: "w7-57", Units: 1, Node: "n3", Seq: 182, Refunded: true},
			{Account: "rl-003", EventID: "w7-57\x1f1", Units: 1, Node: "n3", Seq: 187, Refunded: retryRefunded},
		}}}
	}
	for _, tc := range []struct {
		name    string
		first   Status
		retry   bool
		verdict string
	}{
		{"first attempt undecided, retry billed", StatusUnknown, false, Held},
		{"first attempt acknowledged", StatusOK, false, Violated},
		{"first attempt undecided, retry refunded too", StatusUnknown, true, Violated},
	} {
		r := CheckG4(&CheckInput{Ops: ops(tc.first), Ledger: ledger(tc.retry)})
		if r.Verdict != tc.verdict {
			t.Errorf("%s: %s (%v), want %s", tc.name, r.Verdict, r.Violations, tc.verdict)
		}
	}
}
