package shard

import (
	"testing"
	"time"
)

// hoursAfter gives the time n hours after t0, on both clocks.
func hoursAfter(t0 Now) func(n int) Now {
	return func(n int) Now {
		return Now{Wall: t0.Wall + int64(n)*int64(time.Hour), Mono: t0.Mono + int64(n)*int64(time.Hour)}
	}
}

// An Idempotency-Key used again after the dedup window is new work: the
// owner charges it, and names it apart from the earlier use for the
// ledger (the id's next generation), which bills an event id once a month.
// Named alike, the second use was taken for a retry and never billed.
func TestAKeyUsedAgainAfterTheWindowIsBilledApart(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(1000)})
	t0 := at("2026-06-02T00:00:00Z")
	h := hoursAfter(t0)
	names := map[string]bool{}
	use := func(when Now, want Reason, wantGen uint32) {
		t.Helper()
		d, rec := charge(a, "k", 2, when, &p)
		if d.Reason != want {
			t.Fatalf("k at %v: %s, want %s", time.Unix(0, when.Wall).UTC(), d.Reason, want)
		}
		if rec.Gen != wantGen {
			t.Fatalf("k at %v: generation %d, want %d", time.Unix(0, when.Wall).UTC(), rec.Gen, wantGen)
		}
		if want == OK {
			names[LedgerEventID("k", rec.Gen)] = true
		}
	}
	use(h(0), OK, 0)
	use(h(1), Replayed, 0)
	use(h(25), OK, 1) // a day later: new work, a new name
	use(h(30), Replayed, 1)
	use(h(50), OK, 2)
	if len(names) != 3 {
		t.Fatalf("three uses billed under %d names: %v", len(names), names)
	}
	// A use refunded (its work failed): the next use after the window
	// takes its generation, which the ledger bills in its place.
	var rec Record
	if d := a.Refund("k", nil, "", h(51), &p, &rec); d.Reason != Refunded {
		t.Fatal(d.Reason)
	}
	use(h(80), OK, 2)
	// July: the ledger's names start again.
	use(Now{Wall: at("2026-07-01T00:00:01Z").Wall, Mono: h(700).Mono}, OK, 0)
}

// An id the dedup window let go early (beyond DedupMax) and charged again
// within the window is a retry, not new work: it keeps its generation, so
// the ledger bills it once; after a refund, the next, as the window gives.
func TestAKeyLetGoEarlyIsRetriedUnderItsGeneration(t *testing.T) {
	p := DefaultParams()
	p.DedupMax = 1
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(1000)})
	now := at("2026-06-10T00:00:00Z")
	charge(a, "x", 1, now, &p)
	charge(a, "y", 1, now, &p) // x let go
	if d, rec := charge(a, "x", 1, now, &p); d.Reason != OK || rec.Gen != 0 {
		t.Fatalf("x retried after it was let go: %s generation %d, want ok 0", d.Reason, rec.Gen)
	}
	var rec Record
	charge(a, "r", 1, now, &p)
	if d := a.Refund("r", nil, "", now, &p, &rec); d.Reason != Refunded {
		t.Fatal(d.Reason)
	}
	charge(a, "z", 1, now, &p) // r (refunded) let go
	if d, rec := charge(a, "r", 1, now, &p); d.Reason != OK || rec.Gen != 1 {
		t.Fatalf("r retried after its refund, let go: %s generation %d, want ok 1", d.Reason, rec.Gen)
	}
}

// What an account keeps of the ids it let go survives a restart: stored
// apart with the checkpoint, and rebuilt from the log.
func TestSpentIDsSurviveARestart(t *testing.T) {
	p := DefaultParams()
	cfg := AccountConfig{ID: "a", Plan: hardPlan(1000)}
	a := NewAccount(cfg)
	var log recordLog
	t0 := at("2026-06-02T00:00:00Z")
	h := hoursAfter(t0)
	for _, c := range []struct {
		id string
		at Now
	}{{"k", h(0)}, {"k", h(25)}, {"other", h(50)}} {
		_, rec := charge(a, c.id, 1, c.at, &p)
		log.keep(rec)
	}
	// k (generation 1) was let go at the last charge.
	var ids []StoredID
	a.DrainIDs(func(s StoredID) {
		if s.Value != nil { // nil: dropped since the last drain
			ids = append(ids, s)
		}
	})
	apart := NewAccount(cfg)
	if err := apart.RestoreCheckpoint(a.AppendCheckpointState(nil)); err != nil {
		t.Fatal(err)
	}
	if err := apart.RestoreIDs(ids); err != nil {
		t.Fatal(err)
	}
	for name, b := range map[string]*Account{"from the checkpoint": apart, "from the log": log.rebuild(t, cfg, &p)} {
		if d, rec := charge(b, "k", 1, h(51), &p); d.Reason != OK || rec.Gen != 2 {
			t.Errorf("%s: k used again: %s generation %d, want ok 2", name, d.Reason, rec.Gen)
		}
	}
	bad := []StoredID{{Kind: IDSpent, ID: "k", Value: appendSpentValue(nil, 1, spentID{gen: 1})}}
	bad[0].Value[len(bad[0].Value)-1] = 4
	if err := NewAccount(cfg).RestoreIDs(bad); err == nil {
		t.Error("a spent id with flags this build does not know restored without error")
	}
}

// An account that came back from another owner (ForgetIDs) gives
// generation 0 again: the other owner may have charged the id within the
// window, at generation 0, and a retry of that charge must meet it in the
// ledger, not be billed a second time under a name the other owner never
// gave.
func TestAnAccountBackFromAnotherOwnerForgetsItsSpentIDs(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(1000)})
	t0 := at("2026-06-02T00:00:00Z")
	charge(a, "k", 1, t0, &p)
	charge(a, "other", 1, Now{Wall: t0.Wall + int64(25*time.Hour), Mono: t0.Mono + int64(25*time.Hour)}, &p)
	a.ForgetIDs()
	if d, rec := charge(a, "k", 1, Now{Wall: t0.Wall + int64(26*time.Hour), Mono: t0.Mono + int64(26*time.Hour)}, &p); d.Reason != OK || rec.Gen != 0 {
		t.Fatalf("k after the account came back: %s generation %d, want ok 0", d.Reason, rec.Gen)
	}
}

// receiptOf is the receipt the engine gives for a charge's record, made at
// node.
func receiptOf(rec Record, node string) *Receipt {
	return &Receipt{EventID: rec.EventID, Account: rec.Account, Node: node, Units: rec.Units, Period: rec.Period, Wall: rec.Wall,
		Key: rec.Key, Route: rec.Route, Gen: rec.Gen, Allocs: append([]Alloc(nil), rec.Allocs...)}
}

// A receipt names one charge: refunded while a later charge of the same id
// is in the dedup window (a use past the window, or a retry after a
// refund), it refunds its own charge, once, not the one the window
// remembers. It refunded the later one, and after a refund and a retry the
// first charge's receipt refunded the retry.
func TestAReceiptRefundsItsOwnChargeNotALaterOne(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(1000)})
	t0 := at("2026-06-02T00:00:00Z")
	h := hoursAfter(t0)
	refund := func(id string, r *Receipt, when Now, want Reason, wantWall int64) {
		t.Helper()
		var rec Record
		d := a.Refund(id, r, "n1", when, &p, &rec)
		if d.Reason != want || (want == Refunded && rec.ChargeWall != wantWall) {
			t.Fatalf("refund of %s: %s of the charge at %v, want %s of the one at %v", id, d.Reason,
				time.Unix(0, rec.ChargeWall).UTC(), want, time.Unix(0, wantWall).UTC())
		}
	}
	_, first := charge(a, "k", 2, h(0), &p)
	_, second := charge(a, "k", 3, h(30), &p) // past the window: generation 1
	refund("k", receiptOf(first, "n1"), h(31), Refunded, first.Wall)
	refund("k", receiptOf(first, "n1"), h(32), AlreadyRefunded, 0)
	refund("k", nil, h(33), Refunded, second.Wall)
	if u := a.Usage(h(34)); u.Used != 0 {
		t.Fatalf("used %d after both refunds, want 0", u.Used)
	}

	_, r0 := charge(a, "x", 1, h(40), &p)
	refund("x", nil, h(40), Refunded, r0.Wall)
	_, r1 := charge(a, "x", 1, h(41), &p) // the retry: generation 1
	if r1.Gen != 1 {
		t.Fatalf("retry after a refund: generation %d, want 1", r1.Gen)
	}
	refund("x", receiptOf(r0, "n1"), h(42), AlreadyRefunded, 0)
	if u := a.Usage(h(42)); u.Used != 1 {
		t.Fatalf("used %d after the first charge's receipt came again, want 1 (the retry)", u.Used)
	}
}

// A wall clock that jumps forward past the dedup window within a month
// does not make a retry new work: the monotonic clock says how long ago
// this process made the charge, and the retry keeps its generation (the
// ledger bills it once). A use a day later by both clocks is new work.
func TestAWallClockJumpDoesNotMakeARetryNewWork(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(1000)})
	t0 := at("2026-06-02T00:00:00Z")
	charge(a, "k", 1, t0, &p)
	jumped := Now{Wall: t0.Wall + int64(48*time.Hour), Mono: t0.Mono + int64(time.Minute)}
	if d, rec := charge(a, "k", 1, jumped, &p); d.Reason != OK || rec.Gen != 0 {
		t.Fatalf("a retry a minute later, the wall clock two days on: %s generation %d, want ok 0 (billed once)", d.Reason, rec.Gen)
	}
	later := Now{Wall: t0.Wall + int64(80*time.Hour), Mono: t0.Mono + int64(30*time.Hour)}
	if d, rec := charge(a, "k", 1, later, &p); d.Reason != OK || rec.Gen != 1 {
		t.Fatalf("a use more than a day later by both clocks: %s generation %d, want ok 1", d.Reason, rec.Gen)
	}
}
