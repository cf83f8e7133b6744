package engine

import (
	"context"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// A node whose clock ran a month ahead for a moment, then was put right
// (NTP), keeps in the later month only the accounts it billed there (a
// period never goes back, G9); every other account, and every account
// after a restart from the same data dir, follows the corrected clock. A
// node-wide floor on the clock used to bill every account the node touched
// afterwards in the later month until the calendar caught up. An account
// only a refusal named the later month to stays there across a restart too.
func TestClockPutRightLeavesOnlyTheAccountsBilledAhead(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	s := testSnapshot(t, map[string]int64{"ahead": 100, "after": 100, "fresh": 100, "refused": 1})
	clock := NewSystemClock()
	e := openEngine(t, dir, clock, s)
	l := e.Log()
	// resets of this month and the next, by the real clock
	thisMonth := func() int64 { return shard.PeriodOf(time.Now().UnixNano()).End() / 1e9 }
	nextMonth := func() int64 { return (shard.PeriodOf(time.Now().UnixNano()) + 1).End() / 1e9 }
	charge := func(e *Engine, account, id string, want func() int64, when string) {
		t.Helper()
		units, reason := int64(1), shard.OK
		if account == "refused" {
			units, reason = 2, shard.QuotaExceeded // a refusal logs nothing
		}
		res, err := e.Charge(ctx, account, shard.Charge{EventID: id, ClientID: true, Units: units})
		if err != nil || res.Reason != reason {
			t.Fatalf("%s: charge %s: %v %v, want %v", when, account, res.Reason, err, reason)
		}
		if w := want(); res.Reset != w {
			t.Fatalf("%s: %s answered with reset %s, want %s", when, account,
				time.Unix(res.Reset, 0).UTC().Format(time.DateOnly), time.Unix(w, 0).UTC().Format(time.DateOnly))
		}
	}

	now := time.Now().UTC()
	clock.SetOffset(time.Date(now.Year(), now.Month()+1, 1, 1, 0, 0, 0, time.UTC).Sub(now))
	charge(e, "ahead", "a1", nextMonth, "clock a month ahead")
	charge(e, "refused", "r1", nextMonth, "clock a month ahead")
	clock.SetOffset(0)
	charge(e, "after", "b1", thisMonth, "clock put right")
	charge(e, "ahead", "a2", nextMonth, "clock put right")
	if err := e.Settle(ctx, l.DurableSeq()); err != nil {
		t.Fatal(err)
	}
	charge(e, "after", "b2", thisMonth, "after a settle")
	e.Close()
	l.Close()

	e2 := openEngine(t, dir, NewSystemClock(), nil)
	charge(e2, "fresh", "c1", thisMonth, "after a restart")
	charge(e2, "after", "b3", thisMonth, "after a restart")
	charge(e2, "ahead", "a3", nextMonth, "after a restart")
	// Only a refusal ever named the later month to this account: the
	// checkpoint kept it.
	charge(e2, "refused", "r2", nextMonth, "after a restart")
}
