package shard

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

func at(s string) Now {
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		panic(err)
	}
	return Now{Wall: t.UnixNano(), Mono: t.UnixNano()}
}

func hardPlan(quota int64) Plan { return Plan{ID: "p", MonthlyQuota: quota, Hard: true} }

// reservationsOn10June is the params of a node with a ledger (reservations
// on), 10 June 2026, and June's monthly grant id.
func reservationsOn10June() (Params, Now, string) {
	p := DefaultParams()
	p.Reservations = true
	now := at("2026-06-10T00:00:00Z")
	return p, now, MonthlyGrantID(PeriodOf(now.Wall))
}

func charge(a *Account, id string, units int64, now Now, p *Params) (Decision, Record) {
	var rec Record
	d := a.Charge(&Charge{EventID: id, ClientID: true, Key: "k1", Route: "GET /x", Units: units}, now, p, &rec)
	return d, rec
}

func TestRefusedChargeLeavesNoTraceAndItsIDIsReusable(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	now := at("2026-06-10T00:00:00Z")
	if d, _ := charge(a, "e1", 8, now, &p); d.Reason != OK || d.Remaining != 2 {
		t.Fatalf("first charge: %+v", d)
	}
	d, rec := charge(a, "e2", 5, now, &p)
	if d.Reason != QuotaExceeded || rec.Type != 0 {
		t.Fatalf("too big: got %v with record type %v, want quota_exceeded and no record", d.Reason, rec.Type)
	}
	if d.Remaining != 2 {
		t.Fatalf("refusal changed the balance: remaining %d", d.Remaining)
	}
	d, rec = charge(a, "e2", 2, now, &p)
	if d.Reason != OK || rec.Type != RecCharge || rec.Units != 2 || d.Remaining != 0 {
		t.Fatalf("same id, smaller: %+v %+v", d, rec)
	}
}

func TestRetriesCostOnce(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	now := at("2026-06-10T00:00:00Z")
	records := 0
	for i := 0; i < 5; i++ {
		d, rec := charge(a, "same", 7, now, &p)
		if !d.Reason.Accepted() || d.Units != 7 {
			t.Fatalf("try %d: %+v", i, d)
		}
		if rec.Type == RecCharge {
			records++
		}
		if i > 0 && d.Reason != Replayed {
			t.Fatalf("try %d: %v, want replayed", i, d.Reason)
		}
	}
	if u := a.Usage(now); u.Used != 7 || u.Remaining != 93 || records != 1 {
		t.Fatalf("used %d remaining %d records %d, want 7, 93, 1", u.Used, u.Remaining, records)
	}
}

func TestRefundTwiceReturnsOnce(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	now := at("2026-06-10T00:00:00Z")
	charge(a, "e", 4, now, &p)
	var rec Record
	d := a.Refund("e", nil, "", now, &p, &rec)
	if d.Reason != Refunded || d.Units != 4 || rec.Type != RecRefund || d.Remaining != 10 {
		t.Fatalf("first refund: %+v rec %v", d, rec.Type)
	}
	d = a.Refund("e", nil, "", now, &p, &rec)
	if d.Reason != AlreadyRefunded || rec.Type != 0 || d.Remaining != 10 {
		t.Fatalf("second refund: %+v rec %v", d, rec.Type)
	}
}

func TestRefundByReceiptOnce(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	now := at("2026-06-10T00:00:00Z")
	var rec Record
	d := a.Charge(&Charge{EventID: "gen-1", Units: 3, Route: "r"}, now, &p, &rec)
	if d.Reason != OK {
		t.Fatal(d.Reason)
	}
	rc := &Receipt{EventID: "gen-1", Units: 3, Period: rec.Period, Wall: rec.Wall, Route: "r", Allocs: append([]Alloc(nil), rec.Allocs...)}
	if d := a.Refund("gen-1", nil, "", now, &p, &rec); d.Reason != UnknownEvent {
		t.Fatalf("generated id without receipt: %v, want unknown_event", d.Reason)
	}
	if d := a.Refund("gen-1", rc, "", now, &p, &rec); d.Reason != Refunded || d.Remaining != 10 {
		t.Fatalf("with receipt: %+v", d)
	}
	if d := a.Refund("gen-1", rc, "", now, &p, &rec); d.Reason != AlreadyRefunded || d.Remaining != 10 {
		t.Fatalf("receipt twice: %+v", d)
	}
}

// A refusal says when to retry only when waiting can help: a request that
// costs more than next month gives (its quota and the credits active then)
// was told to come back next month, and refused again then.
func TestRetryAfterOnlyWhenWaitingHelps(t *testing.T) {
	p := DefaultParams()
	now := at("2026-06-10T00:00:00Z")
	toJuly := at("2026-07-01T00:00:00Z").Wall - now.Wall
	for _, c := range []struct {
		name    string
		credits []GrantConfig
		units   int64
		want    int64
	}{
		{"within next month's quota", nil, 8, toJuly},
		// 20 credits left now, short of 25: next month adds 10.
		{"past any month's quota", nil, 25, Never},
		{"past the quota, within it and a credit", []GrantConfig{{ID: "c", Units: 20, StartsAt: now.Wall - 1, ExpiresAt: at("2026-09-01T00:00:00Z").Wall}}, 25, toJuly},
		{"past the quota and a credit that ends with June", []GrantConfig{{ID: "c", Units: 20, StartsAt: now.Wall - 1, ExpiresAt: at("2026-07-01T00:00:00Z").Wall}}, 25, Never},
		// Credits bought that start later this month: retry when they
		// start (it said next month, or never), the earliest that fits.
		{"a credit that starts in 10 minutes", []GrantConfig{{ID: "c", Units: 20, StartsAt: now.Wall + int64(10*time.Minute)}}, 8, int64(10 * time.Minute)},
		{"credits that start later, the first too small", []GrantConfig{{ID: "c1", Units: 3, StartsAt: now.Wall + int64(time.Hour)},
			{ID: "c2", Units: 5, StartsAt: now.Wall + int64(2*time.Hour)}}, 8, int64(2 * time.Hour)},
		{"a credit that starts later, too small", []GrantConfig{{ID: "c", Units: 3, StartsAt: now.Wall + int64(time.Hour)}}, 8, toJuly},
	} {
		a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10), Credits: c.credits})
		var rec Record
		if d := a.Charge(&Charge{EventID: "fill", Units: 10, Route: "r"}, now, &p, &rec); d.Reason != OK {
			t.Fatalf("%s: using the month up: %v", c.name, d.Reason)
		}
		d := a.Charge(&Charge{EventID: "e", Units: c.units, Route: "r"}, now, &p, &rec)
		if d.Reason != QuotaExceeded || d.RetryAfter != c.want {
			t.Errorf("%s: %v, retry after %d; want quota_exceeded, %d", c.name, d.Reason, d.RetryAfter, c.want)
		}
		if credits := c.want != toJuly && c.want != Never; d.CreditsStart != credits {
			t.Errorf("%s: CreditsStart %v, want %v", c.name, d.CreditsStart, credits)
		}
	}
	// A prepaid plan (no monthly quota) with credits that start later.
	prepaid := hardPlan(0)
	a := NewAccount(AccountConfig{ID: "a", Plan: prepaid, Credits: []GrantConfig{{ID: "c", Units: 50, StartsAt: now.Wall + int64(3*time.Hour)}}})
	var rec Record
	if d := a.Charge(&Charge{EventID: "e", Units: 1, Route: "r"}, now, &p, &rec); d.Reason != QuotaExceeded || d.RetryAfter != int64(3*time.Hour) || !d.CreditsStart {
		t.Errorf("prepaid, credits in 3 hours: %v, retry after %d; want quota_exceeded, 3h", d.Reason, d.RetryAfter)
	}
}

// A client id with the shape of an id quotaring makes (the engine's for a
// request without an Idempotency-Key, which the upstream sees as
// X-Quota-Event; router.Client's), or with a separator of the ledger's
// event names, could name another charge's event in the ledger, which
// then took the client's charge for a retry of it and billed nothing: it
// is Invalid. The same text with ClientID false (made ids) is taken.
func TestClientIDsThatCouldNameAnotherEventAreInvalid(t *testing.T) {
	p := DefaultParams()
	now := at("2026-06-10T00:00:00Z")
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	var rec Record
	for _, id := range []string{"74J561BS-6", "00000000-zz", "VVVVVVVV-0123456789abc", "cABCDEFGHIJKLMNOPQRSTUVWXYZ", "c234567ABCDEFGHIJKLMNOPQRS", "k\x1f1", "k\x1e2026-06"} {
		if len(id) == 26 {
			id += "T" // c and 26 letters
		}
		if d := a.Charge(&Charge{EventID: id, ClientID: true, Units: 1, Route: "r"}, now, &p, &rec); d.Reason != Invalid || rec.Type != 0 {
			t.Errorf("client id %q: %v (record type %d); want invalid, nothing logged", id, d.Reason, rec.Type)
		}
		if ClientIDProblem(id) == "" {
			t.Errorf("ClientIDProblem(%q) is empty", id)
		}
	}
	for _, id := range []string{"74j561bs-6", "74J561BS-", "74J561BS-6-1", "74J561BW-6", "order-42", "cABCDEFGHIJKLMNOPQRSTUVWXY", "c1BCDEFGHIJKLMNOPQRSTUVWXYZ", "550E8400-E29B-41D4-A716-446655440000"} {
		if d := a.Charge(&Charge{EventID: id, ClientID: true, Units: 1, Route: "r"}, now, &p, &rec); d.Reason != OK {
			t.Errorf("client id %q: %v, want ok", id, d.Reason)
		}
	}
	if d := a.Charge(&Charge{EventID: "74J561BS-7", Units: 1, Route: "r"}, now, &p, &rec); d.Reason != OK {
		t.Errorf("a made id without ClientID: %v, want ok", d.Reason)
	}
}

// A charge whose EventID, Key or Route could never be stored is Invalid and
// changes nothing: the log would take it, and then every settle into
// Postgres (which refuses a NUL byte and bytes that are not UTF-8 in text)
// would fail on it, for ever.
func TestChargeWithUnstorableTextIsInvalid(t *testing.T) {
	p := DefaultParams()
	now := at("2026-06-10T00:00:00Z")
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	var rec Record
	long := strings.Repeat("r", MaxTextLen+1)
	for name, c := range map[string]Charge{
		"NUL in the route":       {EventID: "e1", Units: 1, Route: "GET /x\x00"},
		"NUL in the key":         {EventID: "e1", Units: 1, Route: "r", Key: "k\x00"},
		"NUL in the event id":    {EventID: "e\x001", ClientID: true, Units: 1, Route: "r"},
		"not UTF-8 in the route": {EventID: "e1", Units: 1, Route: "GET /\xff"},
		"a route too long":       {EventID: "e1", Units: 1, Route: long},
		"an event id too long":   {EventID: long, ClientID: true, Units: 1, Route: "r"},
	} {
		if d := a.Charge(&c, now, &p, &rec); d.Reason != Invalid || rec.Type != 0 {
			t.Errorf("%s: %v (record type %d); want invalid, nothing logged", name, d.Reason, rec.Type)
		}
	}
	if d := a.Charge(&Charge{EventID: "e1", Units: 1, Route: strings.Repeat("r", MaxTextLen)}, now, &p, &rec); d.Reason != OK {
		t.Errorf("a route of MaxTextLen bytes: %v", d.Reason)
	}
}

// A receipt is the proof of a charge the owner does not remember (a
// generated id): one passed with another account, or altered (units not
// those of its allocations, more than its grant used), is refused Invalid
// and changes nothing. A reviewer refunded 40 twice (once on the wrong
// account) and 500 for a charge of 1, past a hard quota.
func TestAlteredOrMisplacedReceiptIsRefused(t *testing.T) {
	p := DefaultParams()
	now := at("2026-06-10T00:00:00Z")
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	b := NewAccount(AccountConfig{ID: "b", Plan: hardPlan(100)})
	var rec Record
	for _, acct := range []*Account{a, b} {
		if d := acct.Charge(&Charge{EventID: "gen-" + acct.ID(), Units: 40, Route: "r"}, now, &p, &rec); d.Reason != OK {
			t.Fatal(d.Reason)
		}
	}
	good := Receipt{EventID: "gen-b", Account: "b", Node: "n1", Units: 40, Period: rec.Period, Wall: rec.Wall, Route: "r", Allocs: slices.Clone(rec.Allocs)}
	alter := func(f func(*Receipt)) *Receipt {
		r := good
		r.Allocs = slices.Clone(good.Allocs)
		f(&r)
		return &r
	}
	for name, c := range map[string]struct {
		acct *Account
		r    *Receipt
	}{
		"b's receipt on a":            {a, alter(func(*Receipt) {})},
		"units above its allocations": {b, alter(func(r *Receipt) { r.Units = 41 })},
		"more than the grant used":    {b, alter(func(r *Receipt) { r.Units, r.Allocs[0].Units = 500, 500 })},
		"one unit over the grant use": {b, alter(func(r *Receipt) { r.Units, r.Allocs[0].Units = 41, 41 })},
		"no units at all":             {b, alter(func(r *Receipt) { r.Units, r.Allocs = 0, nil })},
		"a negative allocation":       {b, alter(func(r *Receipt) { r.Units, r.Allocs = 40, append(r.Allocs, Alloc{Grant: r.Allocs[0].Grant, Units: -1}) })},
	} {
		before := c.acct.Usage(now)
		if d := c.acct.Refund("gen-b", c.r, "n1", now, &p, &rec); d.Reason != Invalid || rec.Type != 0 {
			t.Errorf("%s: %s, record %v; want invalid, nothing logged", name, d.Reason, rec.Type)
		}
		if d := c.acct.RefundAttempt("gen-b", c.r, "n1", now, &p, &rec); d.Reason != Invalid || rec.Type != 0 {
			t.Errorf("%s, as an attempt's refund: %s, record %v; want invalid, nothing logged", name, d.Reason, rec.Type)
		}
		if u := c.acct.Usage(now); u.Used != before.Used {
			t.Errorf("%s: used %d, was %d", name, u.Used, before.Used)
		}
	}
	// A receipt of another node (the account moved since) is checked too,
	// but for the use: the charge may not be in the use this owner was
	// seeded with (another node made it before a handover).
	moved := alter(func(r *Receipt) { r.Node = "n2" })
	if d := a.RefundAttempt("gen-b", moved, "n1", now, &p, &rec); d.Reason != Invalid || rec.Type != 0 {
		t.Errorf("b's receipt from another node on a: %s, want invalid", d.Reason)
	}
	fresh := NewAccount(AccountConfig{ID: "b", Plan: hardPlan(100)}) // seeded before n2's charge settled
	if d := fresh.Refund("gen-b", moved, "n1", now, &p, &rec); d.Reason != Refunded || d.Remaining != 100 || d.MonthUsed != 0 {
		t.Errorf("a receipt of another node's charge that the use does not hold yet: %+v, want refunded, the use at 0 (never below)", d)
	}
	// The receipt as it was, and one of an older build (no account), refund.
	if d := b.Refund("gen-b", &good, "n1", now, &p, &rec); d.Reason != Refunded || d.Remaining != 100 {
		t.Fatalf("b's own receipt: %+v", d)
	}
	old := Receipt{EventID: "gen-a", Units: 40, Period: good.Period, Wall: good.Wall, Route: "r", Allocs: slices.Clone(good.Allocs)}
	if d := a.Refund("gen-a", &old, "", now, &p, &rec); d.Reason != Refunded {
		t.Fatalf("a receipt without an account (an older build's): %s", d.Reason)
	}
}

// One client id names one request: the HTTP front sends a digest of it
// (Target), and the same id with another target is refused IDReused while
// the owner remembers it, across its restarts (the target is in the
// charge's log record and in the stored id); a target of 0 (a caller
// without one) compares the route only.
func TestOneIDForTwoRequestsIsRefused(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	now := at("2026-06-10T00:00:00Z")
	var rec Record
	ch := func(target uint64) Reason {
		return a.Charge(&Charge{EventID: "k", ClientID: true, Route: "*", Units: 1, Target: target}, now, &p, &rec).Reason
	}
	if r := ch(7); r != OK {
		t.Fatal(r)
	}
	for target, want := range map[uint64]Reason{7: Replayed, 8: IDReused, 0: Replayed} {
		if r := ch(target); r != want {
			t.Errorf("key k with target %d: %s, want %s", target, r, want)
		}
	}
	if u := a.Usage(now); u.Used != 1 {
		t.Errorf("used %d, want 1", u.Used)
	}
	var first Record
	if d := a.Charge(&Charge{EventID: "k2", ClientID: true, Route: "*", Units: 1, Target: 9}, now, &p, &first); d.Reason != OK || first.Target != 9 {
		t.Fatalf("second key: %s, record target %d, want ok and 9", d.Reason, first.Target)
	}
	// Restarted three ways: from a checkpoint with the ids inline (an
	// older build's), from one with the ids stored apart (DrainIDs, as the
	// engine does), and from the log alone.
	inline := NewAccount(AccountConfig{ID: "a", Plan: a.Plan()})
	if err := inline.RestoreCheckpoint(a.AppendCheckpoint(nil)); err != nil {
		t.Fatal(err)
	}
	apart := NewAccount(AccountConfig{ID: "a", Plan: a.Plan()})
	var ids []StoredID
	a.DrainIDs(func(id StoredID) { ids = append(ids, id) })
	if err := apart.RestoreCheckpoint(a.AppendCheckpointState(nil)); err != nil {
		t.Fatal(err)
	}
	if err := apart.RestoreIDs(ids); err != nil {
		t.Fatal(err)
	}
	logged := NewAccount(AccountConfig{ID: "a", Plan: a.Plan()})
	var back Record
	if err := back.Decode(first.AppendEncode(nil)); err != nil {
		t.Fatal(err)
	}
	logged.ApplyRecord(1, &back, &p)
	for name, r := range map[string]*Account{"inline checkpoint": inline, "ids apart": apart, "log": logged} {
		if d := r.Charge(&Charge{EventID: "k2", ClientID: true, Route: "*", Units: 1, Target: 8}, now, &p, &rec); d.Reason != IDReused {
			t.Errorf("restored from the %s, key k2 with another target: %s, want id_reused", name, d.Reason)
		}
		if d := r.Charge(&Charge{EventID: "k2", ClientID: true, Route: "*", Units: 1, Target: 9}, now, &p, &rec); d.Reason != Replayed {
			t.Errorf("restored from the %s, key k2 with its own target: %s, want replayed", name, d.Reason)
		}
	}
}

// A stored id written before targets were kept (no flag bit 2) still
// restores, comparing the route only; one whose flag promises a target it
// does not hold, or holds a target of 0, is corrupt; one with a flag bit
// this build does not know is refused as a newer quotad's.
func TestStoredIDTargetEncoding(t *testing.T) {
	e := event{units: 1, key: "k", route: "*", target: 5}
	b := appendDedupValue(nil, 10, &e)
	d := decoder{b: b}
	if _, got := d.dedupValue(); d.err != nil || len(d.b) != 0 || got.target != 5 {
		t.Fatalf("round trip: target %d, err %v, %d bytes left", got.target, d.err, len(d.b))
	}
	e.target = 0
	old := appendDedupValue(nil, 10, &e)
	if len(old) != len(b)-8 {
		t.Fatalf("no target takes %d bytes, with one %d: want 8 more", len(old), len(b))
	}
	d = decoder{b: old}
	if _, got := d.dedupValue(); d.err != nil || len(d.b) != 0 || got.target != 0 {
		t.Fatalf("without a target: %d, err %v", got.target, d.err)
	}
	d = decoder{b: b[:len(b)-1]}
	if d.dedupValue(); d.err == nil {
		t.Fatal("a truncated target decoded")
	}
	zero := append(append([]byte(nil), b[:len(b)-8]...), 0, 0, 0, 0, 0, 0, 0, 0)
	d = decoder{b: zero}
	if d.dedupValue(); d.err == nil {
		t.Fatal("a target of 0 behind the flag decoded")
	}
	// A flag bit this build does not know is a newer quotad's: said so.
	newer := slices.Clone(b)
	const flagsAt = 1 + 1 + 1 + 1 + 1 + 1 // gen 0, wall 10, units 1, seq 0, period 0, charge wall 0
	if newer[flagsAt] != 4 {
		t.Fatalf("the test's flags offset is wrong: byte %d is %#x, want the target flag 0x4", flagsAt, newer[flagsAt])
	}
	newer[flagsAt] |= 8
	d = decoder{b: newer}
	if d.dedupValue(); d.err == nil || !strings.Contains(d.err.Error(), "newer quotad") {
		t.Fatalf("a stored id with an unknown flag: %v, want an error that names a newer quotad", d.err)
	}
}

// A receipt is refunded in its charge's month and the next, never later
// (Refundable): the ledger may have pruned the event log of the months
// before, and could not tell a second refund of such a charge from a first.
// Nothing of a refused refund is logged or returned.
func TestReceiptsOfMonthsBeforeLastAreNotRefunded(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: Plan{ID: "p", Hard: true}, Credits: []GrantConfig{
		{ID: "c1", Units: 100, StartsAt: at("2026-01-01T00:00:00Z").Wall}}})
	var rec Record
	receipts := map[string]*Receipt{}
	for _, day := range []string{"2026-04-30T23:59:59Z", "2026-05-31T23:59:59Z"} {
		id := "gen-" + day[:7]
		if d := a.Charge(&Charge{EventID: id, Units: 5, Route: "r"}, at(day), &p, &rec); d.Reason != OK {
			t.Fatalf("charge in %s: %v", day[:7], d.Reason)
		}
		receipts[id] = &Receipt{EventID: id, Node: "n1", Units: 5, Period: rec.Period, Wall: rec.Wall, Route: "r", Allocs: append([]Alloc(nil), rec.Allocs...)}
	}
	june := at("2026-06-01T00:00:00Z")
	for _, attempt := range []bool{false, true} {
		for _, self := range []string{"n1", "n2"} { // this node's charge, or another's (the account moved)
			var d Decision
			if attempt {
				d = a.RefundAttempt("gen-2026-04", receipts["gen-2026-04"], self, june, &p, &rec)
			} else {
				d = a.Refund("gen-2026-04", receipts["gen-2026-04"], "", june, &p, &rec)
			}
			if d.Reason != UnknownEvent || rec.Type != 0 || d.Units != 0 {
				t.Fatalf("April's receipt in June (attempt %v, node %s): %v with record type %v, want unknown_event and no record", attempt, self, d.Reason, rec.Type)
			}
		}
	}
	if got := a.Usage(june).Remaining; got != 90 {
		t.Fatalf("remaining %d after the refused refunds, want 90", got)
	}
	if d := a.Refund("gen-2026-05", receipts["gen-2026-05"], "", june, &p, &rec); d.Reason != Refunded || rec.Type != RecRefund || d.Remaining != 95 {
		t.Fatalf("May's receipt in June: %+v (record type %v), want refunded", d, rec.Type)
	}
	if !Refundable(PeriodOf(june.Wall)-1, PeriodOf(june.Wall)) || Refundable(PeriodOf(june.Wall)-2, PeriodOf(june.Wall)) {
		t.Fatal("Refundable: want last month yes, the month before no")
	}
}

// The example of the issue: 60 units a month, weights 1, 2 and 25.
func TestMonthlyQuotaWithWeights(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(60)})
	now := at("2026-06-28T12:00:00Z")
	steps := []struct {
		route     string
		units     int64
		want      Reason
		remaining int64
	}{
		{"GET /v1/tasks", 1, OK, 59},
		{"POST /v1/tasks", 2, OK, 57},
		{"POST /v1/exports", 25, OK, 32},
		{"POST /v1/exports", 25, OK, 7},
		{"POST /v1/exports", 25, QuotaExceeded, 7},
		{"GET /v1/tasks", 1, OK, 6},
	}
	for i, s := range steps {
		var rec Record
		d := a.Charge(&Charge{EventID: fmt.Sprint("e", i), Route: s.route, Units: s.units}, now, &p, &rec)
		if d.Reason != s.want || d.Remaining != s.remaining || d.Limit != 60 {
			t.Fatalf("step %d %s: %v remaining %d limit %d, want %v %d 60", i, s.route, d.Reason, d.Remaining, d.Limit, s.want, s.remaining)
		}
		if d.Reason == QuotaExceeded && d.RetryAfter != int64(216000*time.Second) {
			t.Fatalf("retry after %v, want 216000s (to 1 July 00:00 UTC)", time.Duration(d.RetryAfter))
		}
	}
	u := a.Usage(now)
	want := map[string]int64{"GET /v1/tasks": 2, "POST /v1/tasks": 2, "POST /v1/exports": 50}
	if fmt.Sprint(u.Routes) != fmt.Sprint(want) || u.Used != 54 {
		t.Fatalf("usage %v (used %d), want %v", u.Routes, u.Used, want)
	}
}

func TestPeriodBoundaryIsMidnightUTC(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(5)})
	if d, _ := charge(a, "e1", 5, at("2026-07-31T23:59:59Z"), &p); d.Reason != OK {
		t.Fatal(d.Reason)
	}
	if d, _ := charge(a, "e2", 1, at("2026-07-31T23:59:59.999999999Z"), &p); d.Reason != QuotaExceeded {
		t.Fatalf("last ns of July: %v, want quota_exceeded (still the old period)", d.Reason)
	}
	d, rec := charge(a, "e3", 1, at("2026-08-01T00:00:00Z"), &p)
	if d.Reason != OK || d.Remaining != 4 || rec.Period.String() != "2026-08" {
		t.Fatalf("1 August 00:00:00: %+v period %s", d, rec.Period)
	}
	if got := time.Unix(d.Reset, 0).UTC().Format(time.RFC3339); got != "2026-09-01T00:00:00Z" {
		t.Fatalf("reset %s", got)
	}
}

func TestClockJumpBackNeverReturnsToAnEarlierPeriod(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(5)})
	charge(a, "e1", 5, at("2026-06-30T23:00:00Z"), &p)
	charge(a, "e2", 5, at("2026-07-01T00:00:01Z"), &p)
	// The wall clock jumps back into June: the account stays in July, whose
	// grant is spent, and the June grant is not spendable again.
	d, rec := charge(a, "e3", 1, at("2026-06-15T00:00:00Z"), &p)
	if d.Reason != QuotaExceeded || rec.Type != 0 {
		t.Fatalf("after a jump back: %v, want quota_exceeded", d.Reason)
	}
	if u := a.Usage(at("2026-06-15T00:00:00Z")); u.Period.String() != "2026-07" {
		t.Fatalf("period went back to %s", u.Period)
	}
}

// The node's clock may step back (an NTP correction); the account's records
// never do: each carries the latest reading the account has seen, so a
// refund is never dated before the charge it refunds, nor a retry charged
// after a refund before that refund (the ledger orders them by these walls).
func TestRecordWallsNeverGoBackWhenTheClockDoes(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	_, c := charge(a, "e1", 1, at("2026-06-10T12:00:30Z"), &p)
	back := at("2026-06-10T12:00:00Z")
	var r Record
	if d := a.Refund("e1", nil, "", back, &p, &r); d.Reason != Refunded {
		t.Fatalf("refund: %v", d.Reason)
	}
	_, again := charge(a, "e1", 1, back, &p)
	if r.Wall != c.Wall || again.Wall != c.Wall || again.Gen != 1 {
		t.Fatalf("walls charge %d, refund %d, retry %d (gen %d): want the charge's for all three, the clock went back 30 s",
			c.Wall, r.Wall, again.Wall, again.Gen)
	}
	// Once the clock passes the account's reading, records follow it again.
	_, later := charge(a, "e2", 1, at("2026-06-10T12:01:00Z"), &p)
	if later.Wall != at("2026-06-10T12:01:00Z").Wall {
		t.Fatalf("wall %d after the clock caught up", later.Wall)
	}
}

// An account billed in a later month by another node (whose clock ran
// ahead) moves there: at once for a new owner, at the next config for one
// that kept it in memory; and never back (G9).
func TestLaterMonthInTheLedgerIsCaughtUp(t *testing.T) {
	p := DefaultParams()
	nov := at("2026-11-30T12:00:00Z")
	later := AccountConfig{ID: "a", Plan: hardPlan(10), MonthlyUsed: map[string]int64{"m:2026-11": 2, "m:2026-12": 3}}
	fresh := NewAccount(later)
	if d, _ := charge(fresh, "e1", 1, nov, &p); d.Reason != OK || d.Remaining != 6 || d.Reset != at("2027-01-01T00:00:00Z").Wall/1e9 {
		t.Fatalf("new owner: %+v, want ok in December with 6 left", d)
	}
	kept := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10), MonthlyUsed: map[string]int64{"m:2026-11": 2}})
	if d, _ := charge(kept, "e1", 1, nov, &p); d.Reason != OK || d.Reset != at("2026-12-01T00:00:00Z").Wall/1e9 {
		t.Fatalf("before the refresh: %+v, want ok in November", d)
	}
	kept.Configure(later)
	if d, _ := charge(kept, "e2", 1, nov, &p); d.Reason != OK || d.Remaining != 6 || d.Reset != at("2027-01-01T00:00:00Z").Wall/1e9 {
		t.Fatalf("after the refresh: %+v, want ok in December with 6 left", d)
	}
	kept.Configure(AccountConfig{ID: "a", Plan: hardPlan(10), MonthlyUsed: map[string]int64{"m:2026-11": 3}})
	if u := kept.Usage(nov); u.Period.String() != "2026-12" {
		t.Fatalf("a config without December moved the account back to %s", u.Period)
	}
}

func TestCreditsSoonestExpiringFirstAndNeverExpired(t *testing.T) {
	p := DefaultParams()
	jun := at("2026-06-10T00:00:00Z")
	cfg := AccountConfig{ID: "a", Plan: hardPlan(10), Credits: []GrantConfig{
		{ID: "old", Units: 100, StartsAt: at("2026-01-01T00:00:00Z").Wall, ExpiresAt: at("2026-06-01T00:00:00Z").Wall},
		{ID: "late", Units: 20, StartsAt: at("2026-01-01T00:00:00Z").Wall, ExpiresAt: at("2026-12-01T00:00:00Z").Wall},
		{ID: "soon", Units: 5, StartsAt: at("2026-01-01T00:00:00Z").Wall, ExpiresAt: at("2026-06-20T00:00:00Z").Wall},
	}}
	a := NewAccount(cfg)
	d, rec := charge(a, "e1", 12, jun, &p)
	want := "[{soon 5} {m:2026-06 7}]"
	if got := fmt.Sprint(rec.Allocs); got != want {
		t.Fatalf("allocation %s, want %s (soonest-expiring first, expired credit untouched)", got, want)
	}
	// The decision tells the month's quota apart from the credits.
	if d.MonthUnits != 10 || d.MonthUsed != 7 || d.Limit != 35 || d.Remaining != 23 {
		t.Fatalf("decision month %d/%d, all grants %d left of %d; want 7/10, 23 of 35", d.MonthUsed, d.MonthUnits, d.Remaining, d.Limit)
	}
	_, rec = charge(a, "e2", 10, jun, &p)
	if got := fmt.Sprint(rec.Allocs); got != "[{m:2026-06 3} {late 7}]" {
		t.Fatalf("second allocation %s", got)
	}
	if d, _ := charge(a, "e3", 14, jun, &p); d.Reason != QuotaExceeded {
		t.Fatalf("13 left in all, 14 asked: %v", d.Reason)
	}
}

// Credits bought "until the end of the year" expire at the same instant as
// December's quota: the quota is spent first, whatever the credit's id.
func TestMonthlyQuotaFirstWhenACreditExpiresWithIt(t *testing.T) {
	p := DefaultParams()
	dec := at("2026-12-10T00:00:00Z")
	end := at("2027-01-01T00:00:00Z").Wall
	for _, id := range []string{"g_01", "credits-1", "a", "m", "zz"} {
		a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10), Credits: []GrantConfig{
			{ID: id, Units: 5000, StartsAt: at("2026-12-01T00:00:00Z").Wall, ExpiresAt: end},
		}})
		_, rec := charge(a, "e1", 12, dec, &p)
		if got, want := fmt.Sprint(rec.Allocs), "[{m:2026-12 10} {"+id+" 2}]"; got != want {
			t.Errorf("credit %q: allocation %s, want %s (the month's quota first)", id, got, want)
		}
	}
	for _, c := range []struct {
		x, y string
		want int
	}{{"m:2026-12", "a", -1}, {"a", "m:2026-12", 1}, {"a", "b", -1}, {"m:2026-12", "m:2026-12", 0}} {
		if got := CompareSpending(c.x, end, c.y, end); got != c.want {
			t.Errorf("CompareSpending(%q, %q) at one expiry = %d, want %d", c.x, c.y, got, c.want)
		}
	}
	if CompareSpending("a", end, "m:2026-12", end+1) != -1 || CompareSpending("m:2026-12", end, "a", 0) != -1 {
		t.Error("an earlier expiry, or any expiry against never, must come first")
	}
}

func TestSoftPlanRecordsOverage(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: Plan{ID: "s", MonthlyQuota: 3}})
	now := at("2026-06-10T00:00:00Z")
	charge(a, "e1", 2, now, &p)
	d, rec := charge(a, "e2", 4, now, &p)
	if d.Reason != OK || fmt.Sprint(rec.Allocs) != "[{m:2026-06 4}]" || d.Remaining != 0 {
		t.Fatalf("soft overage: %+v %v", d, rec.Allocs)
	}
	if g := a.Grants()[0]; g.Used != 6 || g.Units != 3 {
		t.Fatalf("grant %+v, want used 6 of 3 (3 overage)", g)
	}
}

func TestPlanChangeMidPeriod(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	now := at("2026-06-10T00:00:00Z")
	charge(a, "e1", 8, now, &p)
	a.Configure(AccountConfig{ID: "a", Plan: hardPlan(5)})
	if d, _ := charge(a, "e2", 1, now, &p); d.Reason != QuotaExceeded || d.Remaining != 0 {
		t.Fatalf("after a downgrade below usage: %+v", d)
	}
	if u := a.Usage(now); u.Used != 8 {
		t.Fatalf("downgrade erased usage: %d", u.Used)
	}
	a.Configure(AccountConfig{ID: "a", Plan: hardPlan(20)})
	if d, _ := charge(a, "e3", 12, now, &p); d.Reason != OK || d.Remaining != 0 {
		t.Fatalf("after an upgrade: %+v", d)
	}
}

func TestReservationsMode(t *testing.T) {
	p := DefaultParams()
	p.Reservations = true
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	now := at("2026-06-10T00:00:00Z")
	d, _ := charge(a, "e1", 3, now, &p)
	if d.Reason != NeedReservation || d.Shortfall != 3 {
		t.Fatalf("no allowance: %+v", d)
	}
	var rec Record
	if !a.Reserve(MonthlyGrantID(PeriodOf(now.Wall)), 4, now, &rec) || rec.Type != RecReserve {
		t.Fatal("reserve failed")
	}
	if d, _ := charge(a, "e1", 3, now, &p); d.Reason != OK {
		t.Fatalf("with allowance: %v", d.Reason)
	}
	d, _ = charge(a, "e2", 3, now, &p)
	if d.Reason != NeedReservation || d.Shortfall != 2 {
		t.Fatalf("allowance short by 2: %+v", d)
	}
	a.MarkExhausted(MonthlyGrantID(PeriodOf(now.Wall)), now.Mono+int64(time.Second))
	if d, _ := charge(a, "e2", 3, now, &p); d.Reason != QuotaExceeded {
		t.Fatalf("exhausted: %v", d.Reason)
	}
	if d, _ := charge(a, "e2", 1, now, &p); d.Reason != OK {
		t.Fatalf("one unit still reserved: %v", d.Reason)
	}
}

// A plan lowered below use refuses at once in reservations mode too: the
// allowance the ledger reserved under the old plan is not spent past the
// new quota (the ledger lowers units and leaves reservations as they were).
func TestDowngradeStopsAReservedAllowance(t *testing.T) {
	p, now, june := reservationsOn10June()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	var rec Record
	a.Reserve(june, 80, now, &rec)
	if d, _ := charge(a, "e1", 30, now, &p); d.Reason != OK {
		t.Fatalf("under the old plan: %v", d.Reason)
	}
	a.Configure(AccountConfig{ID: "a", Plan: hardPlan(10)})
	if d, _ := charge(a, "e2", 1, now, &p); d.Reason != QuotaExceeded || d.Remaining != 0 {
		t.Fatalf("after a downgrade below use, with 50 units still reserved: %+v, want QuotaExceeded", d)
	}
	a.Configure(AccountConfig{ID: "a", Plan: hardPlan(35)})
	if d, _ := charge(a, "e3", 6, now, &p); d.Reason != QuotaExceeded {
		t.Fatalf("6 more on a quota of 35 with 30 used: %v, want QuotaExceeded", d.Reason)
	}
	if d, _ := charge(a, "e4", 5, now, &p); d.Reason != OK || d.Remaining != 0 {
		t.Fatalf("the last 5 of 35: %+v", d)
	}
}

// An owner that seeded the account before another node's charges were
// settled counts less use than there is. When the ledger finds the grant
// exhausted, answers show its use (Remaining 0 on the refusal, MonthUsed at
// the quota, so the 100 % alert fires), while the ledger is still asked
// again once it grants more.
func TestExhaustedGrantShowsTheLedgersUse(t *testing.T) {
	p, now, june := reservationsOn10June()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(60), MonthlyUsed: map[string]int64{june: 40}})
	var rec Record
	a.Reserve(june, 2, now, &rec) // the ledger: 40 settled + 18 a dead owner charged + 2 for this node
	d, _ := charge(a, "e1", 1, now, &p)
	if d.Reason != OK || d.Remaining != 19 || d.MonthUsed != 41 {
		t.Fatalf("before the ledger says exhausted: %+v", d)
	}
	a.MarkExhausted(june, now.Mono+int64(time.Second))
	d, _ = charge(a, "e2", 2, now, &p)
	if d.Reason != QuotaExceeded || d.Remaining != 1 || d.MonthUsed != 59 || d.MonthUnits != 60 {
		t.Fatalf("exhausted, one unit still reserved: %+v; want Remaining 1, MonthUsed 59", d)
	}
	d, _ = charge(a, "e3", 1, now, &p)
	if d.Reason != OK || d.Remaining != 0 || d.MonthUsed != 60 {
		t.Fatalf("the last unit: %+v; want Remaining 0, MonthUsed 60", d)
	}
	if u := a.Usage(now); u.Used != 60 || u.Remaining != 0 {
		t.Fatalf("usage: %+v", u)
	}
	// Units freed elsewhere (a revoke): past the backoff the ledger is
	// asked again, and what it grants clears the estimate.
	later := Now{Wall: now.Wall, Mono: now.Mono + int64(2*time.Second)}
	if d, _ := charge(a, "e4", 1, later, &p); d.Reason != NeedReservation {
		t.Fatalf("after the backoff: %v, want NeedReservation (ask the ledger again)", d.Reason)
	}
	a.Reserve(june, 5, later, &rec)
	if d, _ := charge(a, "e4", 1, later, &p); d.Reason != OK || d.MonthUsed != 43 {
		t.Fatalf("after a new reservation: %+v; want this owner's own count again", d)
	}
}

// An owner that kept an account in memory while another node charged it
// (the account moved away and back) counts the other's use once the ledger
// has settled it: the next config refresh raises the grant's use to the
// ledger's settled use, never lowers it, and the ledger is still asked
// for units it may have.
func TestConfigureCountsUseSettledElsewhere(t *testing.T) {
	for _, reserved := range []bool{false, true} {
		p := DefaultParams()
		p.Reservations = reserved
		now := at("2026-06-10T00:00:00Z")
		june := MonthlyGrantID(PeriodOf(now.Wall))
		plan := hardPlan(100)
		cfg := AccountConfig{ID: "a", Plan: plan, MonthlyUsed: map[string]int64{june: 10}}
		a := NewAccount(cfg)
		var rec Record
		if reserved {
			a.Reserve(june, 20, now, &rec)
		}
		if d, _ := charge(a, "e1", 5, now, &p); d.Reason != OK || d.MonthUsed != 15 {
			t.Fatalf("reserved=%v: %+v", reserved, d)
		}
		cfg.MonthlyUsed = map[string]int64{june: 45} // this node's 5 and another's 30, settled
		a.Configure(cfg)
		if d, _ := charge(a, "e2", 1, now, &p); d.Reason != OK || d.MonthUsed != 46 || d.Remaining != 54 {
			t.Fatalf("reserved=%v, after the refresh: %+v; want MonthUsed 46, Remaining 54", reserved, d)
		}
		if u := a.Usage(now); u.Used != 46 {
			t.Fatalf("reserved=%v: usage %+v", reserved, u)
		}
		cfg.MonthlyUsed, cfg.UseBehind = map[string]int64{june: 50}, true // read before this owner's records settled: not a lower bound
		a.Configure(cfg)
		if u := a.Usage(now); u.Used != 46 {
			t.Fatalf("reserved=%v: usage after a snapshot behind this owner's log %+v", reserved, u)
		}
		cfg.UseBehind = false
		cfg.MonthlyUsed = map[string]int64{june: 20} // an older snapshot: never lowers
		a.Configure(cfg)
		if u := a.Usage(now); u.Used != 46 {
			t.Fatalf("reserved=%v: usage after an older snapshot %+v", reserved, u)
		}
		if reserved {
			// 14 units of allowance left; a larger charge asks the ledger.
			if d, _ := charge(a, "e3", 20, now, &p); d.Reason != NeedReservation || d.Shortfall != 6 {
				t.Fatalf("past the allowance: %+v, want NeedReservation for 6", d)
			}
		}
	}
}

// Units the ledger reserved in a later month's grant (another node billed
// the account there) move the account to that month, live and on replay;
// an exhausted later grant does too, so the charge is refused as over
// quota rather than asked for again.
func TestReservationInALaterMonth(t *testing.T) {
	p := DefaultParams()
	p.Reservations = true
	jun := at("2026-06-20T00:00:00Z")
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	var rec Record
	if !a.Reserve("m:2026-07", 4, jun, &rec) || rec.Type != RecReserve {
		t.Fatal("a later month's grant was refused")
	}
	d, _ := charge(a, "e1", 3, jun, &p)
	if d.Reason != OK || d.Reset != at("2026-08-01T00:00:00Z").Wall/1e9 {
		t.Fatalf("charge after a July reservation in June: %+v, want ok in July", d)
	}
	b := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	b.ApplyRecord(1, &rec, &p)
	if got := b.Allowance(at("2026-07-01T00:00:00Z").Wall); got != 4 {
		t.Fatalf("replayed allowance %d in July, want 4", got)
	}
	c := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	c.MarkExhausted("m:2026-07", jun.Mono+int64(time.Second))
	if d, _ := charge(c, "e1", 1, jun, &p); d.Reason != QuotaExceeded {
		t.Fatalf("July exhausted, charged in June: %v, want quota_exceeded", d.Reason)
	}
}

func TestRateLimitRefusalTakesNoToken(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: Plan{ID: "r", Rate: Rate{Tokens: 1, Per: time.Second}, Burst: 2, MonthlyQuota: 1, Hard: true}})
	now := at("2026-06-10T00:00:00Z")
	if d, _ := charge(a, "e1", 1, now, &p); d.Reason != OK || d.RateRemaining != 1 {
		t.Fatalf("first charge: %+v", d)
	}
	for i := 0; i < 3; i++ { // quota refusals take no token
		if d, _ := charge(a, fmt.Sprint("q", i), 1, now, &p); d.Reason != QuotaExceeded {
			t.Fatalf("%v", d.Reason)
		}
	}
	if d, _ := charge(a, "free1", 0, now, &p); d.Reason != OK {
		t.Fatalf("weight 0 with a token left: %v", d.Reason)
	}
	d, rec := charge(a, "free2", 0, now, &p)
	if d.Reason != RateLimited || d.RetryAfter != int64(time.Second) || rec.Type != 0 {
		t.Fatalf("empty bucket: %+v", d)
	}
}

func TestRecordRoundTrip(t *testing.T) {
	recs := []Record{
		{Type: RecCharge, Wall: 123, Account: "acct", EventID: "ev", ClientID: true, Key: "k", Route: "GET /x", Units: 9, Period: 24317, Allocs: []Alloc{{"m:2026-06", 4}, {"c1", 5}}},
		{Type: RecCharge, Wall: 124, Account: "acct", EventID: "ev2", ClientID: true, Gen: 1, Key: "k", Route: "GET /x", Units: 9, Period: 24317, Allocs: []Alloc{{"c1", 9}}, Target: 1<<63 | 5},
		{Type: RecRefund, Wall: -5, Account: "a", EventID: "e", Reserved: true, Gen: 3, Key: "k", Route: "r", Units: 3, Period: 1, ChargeWall: 99, Allocs: []Alloc{{"g", 3}}},
		{Type: RecReserve, Wall: 7, Account: "a", Grant: "g", Delta: -40},
		{Type: RecReplay, Wall: 8, Account: "a", EventID: "e", Gen: 2, Period: 24317, Delta: 1},
		{Type: RecReplay, Wall: 9, Account: "a", EventID: "e", Origin: "n2", Period: 24317, Delta: -1},
		{Type: RecRefund, Wall: 10, Account: "a", EventID: "e", Attempt: true, Kept: true, Key: "k", Route: "r", Units: 3, Period: 1, Allocs: []Alloc{{"g", 3}}},
		{Type: RecRefund, Wall: 11, Account: "a", EventID: "e", Attempt: true, Released: true, Reserved: true, Units: 3, Period: 1, Allocs: []Alloc{{"g", 3}}},
		{Type: RecRefund, Wall: 12, Account: "a", EventID: "e", Attempt: true, Released: true, Units: 3, Period: 1, Allocs: []Alloc{{"g", 3}}, ReplaySeq: 41},
		{Type: RecReplay, Wall: 13, Account: "a", EventID: "e", Gen: 2, Period: 24317, Delta: -1, ReplaySeq: 1 << 40},
		{Type: RecReplay, Wall: 14, Account: "a", EventID: "e", Origin: "n2", Period: 24317, Delta: -1, ReplaySeq: 7},
	}
	for _, r := range recs {
		b := r.AppendEncode(nil)
		var got Record
		if err := got.Decode(b); err != nil {
			t.Fatal(err)
		}
		if fmt.Sprintf("%+v", got.AppendEncode(nil)) != fmt.Sprintf("%+v", b) || got.Target != r.Target || got.ReplaySeq != r.ReplaySeq {
			t.Fatalf("round trip of %+v gave %+v", r, got)
		}
		for i := 0; i < len(b); i++ {
			if err := got.Decode(b[:i]); err == nil {
				t.Fatalf("%s truncated to %d bytes decoded without error", r.Type, i)
			}
		}
	}
	// A target is a charge's only: on a refund, bit 7 promises a replay
	// seq, so a refund with a target's 8 bytes behind it is corrupt, as is
	// one whose flags promise more than there is.
	refund := Record{Type: RecRefund, Wall: 10, Account: "a", EventID: "e", Units: 3, Period: 1, Allocs: []Alloc{{"g", 3}}}
	b := refund.AppendEncode(nil)
	const flagsAt = 1 + 1 + 2 + 2 // type, wall 10, "a", "e"
	b[flagsAt] |= 128
	var got Record
	if err := got.Decode(b); err == nil {
		t.Fatal("a refund whose flags promise a target decoded without error")
	}
	if err := got.Decode(binary.LittleEndian.AppendUint64(b, 7)); err == nil {
		t.Fatal("a refund with a target decoded without error")
	}
	// A charge's target of 0 is written as none: 0 behind the flag is corrupt.
	charge := recs[1]
	b = charge.AppendEncode(nil)
	clear(b[len(b)-8:])
	if err := got.Decode(b); err == nil {
		t.Fatal("a charge with a target of 0 behind the flag decoded without error")
	}
}

// recordLog keeps the records an account emits, as the engine's log does,
// and rebuilds the account from them (a restart with no checkpoint since).
type recordLog []Record

func (l *recordLog) keep(rec Record) {
	if rec.Type != 0 {
		*l = append(*l, rec)
	}
}

func (l recordLog) rebuild(t *testing.T, cfg AccountConfig, p *Params) *Account {
	t.Helper()
	a := NewAccount(cfg)
	for i := range l {
		var got Record
		if err := got.Decode(l[i].AppendEncode(nil)); err != nil {
			t.Fatal(err)
		}
		a.ApplyRecord(uint64(i+1), &got, p)
	}
	return a
}

// A replay's record holds its count across a restart, and a refund kept
// for it holds the refund pending: the rebuilt account answers the replay's
// take-back as the live one would have. A replay answered by another node
// is only named in the record (Origin) and changes nothing here.
func TestReplaysAndKeptRefundsSurviveRecovery(t *testing.T) {
	p := DefaultParams()
	cfg := AccountConfig{ID: "a", Plan: hardPlan(10)}
	a := NewAccount(cfg)
	now := at("2026-06-10T00:00:00Z")
	var log recordLog
	keep := log.keep
	d, crec := charge(a, "k", 2, now, &p)
	keep(crec)
	receipt := &Receipt{EventID: "k", Node: "n1", Gen: crec.Gen, Units: 2, Period: crec.Period}
	d, rrec := charge(a, "k", 2, now, &p)
	if d.Reason != Replayed || rrec.Type != RecReplay {
		t.Fatalf("retry: %v, record %v", d.Reason, rrec.Type)
	}
	keep(rrec)
	var rec Record
	if d := a.RefundAttempt("k", receipt, "n1", now, &p, &rec); d.Reason != Kept || !rec.Kept {
		t.Fatalf("the attempt's refund with a replay out: %+v", d)
	}
	keep(rec)
	// Rebuilt from its records (a restart with no checkpoint since).
	b := log.rebuild(t, cfg, &p)
	if u := b.Usage(now); u.Used != 2 {
		t.Fatalf("rebuilt: used %d, want 2 (the kept refund returned nothing)", u.Used)
	}
	// Another node's replay taken back here: a record naming it, nothing
	// changed here.
	other := &Receipt{EventID: "k", Node: "n2", Gen: crec.Gen, Period: crec.Period}
	if d := b.RefundReplay("k", other, "n1", now, &p, &rec); d.Reason != Kept || rec.Type != RecReplay || rec.Origin != "n2" || rec.Delta != -1 {
		t.Fatalf("another node's replay taken back: %+v (record %+v)", d, rec)
	}
	if u := b.Usage(now); u.Used != 2 {
		t.Fatalf("after another node's replay was taken back: used %d, want 2", u.Used)
	}
	// This node's replay taken back: the pending refund applies.
	if d := b.RefundReplay("k", receipt, "n1", now, &p, &rec); d.Reason != Refunded || !rec.Released || rec.Units != 2 {
		t.Fatalf("the replay taken back after a restart: %+v (record %+v), want the pending refund released", d, rec)
	}
	if u := b.Usage(now); u.Used != 0 {
		t.Fatalf("after the release: used %d, want 0", u.Used)
	}
}

// A replay taken back twice with its receipt (the first answer was lost,
// and the HTTP front asked again) counts off once: the second changes
// nothing, logs nothing, and the attempt's refund stays held while the
// other replay may be served. A restart rebuilt from the records still
// knows it was taken back.
func TestAReplayIsTakenBackOnceHoweverOftenAsked(t *testing.T) {
	p := DefaultParams()
	cfg := AccountConfig{ID: "a", Plan: hardPlan(10)}
	a := NewAccount(cfg)
	now := at("2026-06-10T00:00:00Z")
	var log recordLog
	keep := log.keep
	_, crec := charge(a, "k", 2, now, &p)
	keep(crec)
	// Two retries answered Replayed; each receipt names its replay by the
	// seq of its record (the engine's; here the index in log, from 1).
	var replays []*Receipt
	for range 2 {
		d, rrec := charge(a, "k", 2, now, &p)
		if d.Reason != Replayed {
			t.Fatalf("retry: %v", d.Reason)
		}
		keep(rrec)
		replays = append(replays, &Receipt{EventID: "k", Account: "a", Node: "n1", Gen: rrec.Gen, Units: 2, Period: rrec.Period, ReplaySeq: uint64(len(log))})
	}
	var rec Record
	attempt := &Receipt{EventID: "k", Account: "a", Node: "n1", Gen: crec.Gen, Units: 2, Period: crec.Period}
	if d := a.RefundAttempt("k", attempt, "n1", now, &p, &rec); d.Reason != Kept {
		t.Fatalf("the attempt's refund with replays out: %+v", d)
	}
	keep(rec)

	if d := a.RefundReplay("k", replays[0], "n1", now, &p, &rec); d.Reason != Kept || rec.Type != RecReplay || rec.ReplaySeq != replays[0].ReplaySeq {
		t.Fatalf("the first replay taken back: %+v (record %+v)", d, rec)
	}
	keep(rec)
	for i := range 2 {
		if d := a.RefundReplay("k", replays[0], "n1", now, &p, &rec); d.Reason != Kept || rec.Type != 0 {
			t.Fatalf("the first replay taken back again (%d): %+v (record type %v), want Kept and nothing logged", i+1, d, rec.Type)
		}
	}
	if u := a.Usage(now); u.Used != 2 {
		t.Fatalf("used %d, want 2: the second replay may be served, so the attempt's refund stays held", u.Used)
	}

	// Rebuilt from its records: the first replay is still taken back.
	b := log.rebuild(t, cfg, &p)
	if d := b.RefundReplay("k", replays[0], "n1", now, &p, &rec); d.Reason != Kept || rec.Type != 0 {
		t.Fatalf("after a restart, the first replay taken back again: %+v (record type %v), want Kept and nothing logged", d, rec.Type)
	}
	// The second replay taken back releases the refund, once.
	if d := b.RefundReplay("k", replays[1], "n1", now, &p, &rec); d.Reason != Refunded || !rec.Released || rec.ReplaySeq != replays[1].ReplaySeq {
		t.Fatalf("the second replay taken back: %+v (record %+v), want the pending refund released", d, rec)
	}
	if d := b.RefundReplay("k", replays[1], "n1", now, &p, &rec); d.Reason != AlreadyRefunded || rec.Type != 0 {
		t.Fatalf("the second replay taken back again: %+v (record type %v), want AlreadyRefunded and nothing logged", d, rec.Type)
	}
	if u := b.Usage(now); u.Used != 0 {
		t.Fatalf("after the release: used %d, want 0", u.Used)
	}
	// Another owner's records of take-backs name the replay's node: a
	// retry that reaches it after it applied one is no second take-back.
	c := NewAccount(cfg)
	c.ApplyRecord(1, &Record{Type: RecReplay, Wall: now.Wall, Account: "a", EventID: "k", Origin: "n1", Period: crec.Period, Delta: -1, ReplaySeq: replays[0].ReplaySeq}, &p)
	if d := c.RefundReplay("k", replays[0], "n2", now, &p, &rec); d.Reason != Kept || rec.Type != 0 {
		t.Fatalf("at another owner, a take-back it logged asked again: %+v (record type %v), want Kept and nothing logged", d, rec.Type)
	}
	if d := c.RefundReplay("k", replays[1], "n2", now, &p, &rec); rec.Type != RecReplay || rec.Origin != "n1" || rec.ReplaySeq != replays[1].ReplaySeq {
		t.Fatalf("at another owner, n1's other replay taken back: %+v (record %+v), want a record naming it", d, rec)
	}
}

func FuzzRecordDecode(f *testing.F) {
	r := Record{Type: RecCharge, Wall: 1, Account: "a", EventID: "e", Units: 2, Allocs: []Alloc{{"g", 2}}}
	f.Add(r.AppendEncode(nil))
	f.Add([]byte{3, 0, 1, 'a', 1, 'g', 4})
	f.Fuzz(func(t *testing.T, b []byte) {
		var rec Record
		if rec.Decode(b) != nil {
			return
		}
		var again Record
		if err := again.Decode(rec.AppendEncode(nil)); err != nil {
			t.Fatalf("re-encoding a decoded record does not decode: %v", err)
		}
	})
}

func TestCheckpointRestoresState(t *testing.T) {
	p := DefaultParams()
	p.Reservations = true
	cfg := AccountConfig{ID: "a", Plan: hardPlan(100), Credits: []GrantConfig{{ID: "c", Units: 10}}}
	a := NewAccount(cfg)
	now := at("2026-06-10T00:00:00Z")
	var rec Record
	a.Reserve("c", 10, now, &rec)
	a.Reserve(MonthlyGrantID(PeriodOf(now.Wall)), 50, now, &rec)
	charge(a, "e1", 12, now, &p)
	charge(a, "e2", 1, now, &p)
	a.Refund("e2", nil, "", now, &p, &rec)
	a.LastSeq = 42
	b := NewAccount(cfg)
	if err := b.RestoreCheckpoint(a.AppendCheckpoint(nil)); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(a.Grants(), a.Usage(now), a.LastSeq) != fmt.Sprint(b.Grants(), b.Usage(now), b.LastSeq) {
		t.Fatalf("restored %v %v, want %v %v", b.Grants(), b.Usage(now), a.Grants(), a.Usage(now))
	}
	if d, _ := charge(b, "e1", 12, now, &p); d.Reason != Replayed {
		t.Fatalf("dedup lost in checkpoint: %v", d.Reason)
	}
	if d := b.Refund("e2", nil, "", now, &p, &rec); d.Reason != AlreadyRefunded {
		t.Fatalf("refund flag lost: %v", d.Reason)
	}
	if err := b.RestoreCheckpoint([]byte{1, 2}); err == nil {
		t.Fatal("a truncated checkpoint restored without error")
	}
}

var sinkDecision Decision

// go test ./shard -run NONE -bench Charge -benchmem
func BenchmarkCharge(b *testing.B) {
	for _, mode := range []string{"hard", "hard-reserved", "soft-ratelimited"} {
		b.Run(mode, func(b *testing.B) {
			p := DefaultParams()
			plan := Plan{ID: "p", MonthlyQuota: 1 << 60, Hard: true}
			if mode == "soft-ratelimited" {
				plan = Plan{ID: "p", MonthlyQuota: 1 << 60, Rate: Rate{Tokens: 1 << 20, Per: time.Nanosecond}, Burst: 1 << 20}
			}
			p.Reservations = mode == "hard-reserved"
			a := NewAccount(AccountConfig{ID: "acct", Plan: plan})
			now := at("2026-06-10T00:00:00Z")
			var rec Record
			if p.Reservations {
				a.Reserve(MonthlyGrantID(PeriodOf(now.Wall)), 1<<60, now, &rec)
			}
			req := Charge{EventID: "evt", Key: "key", Route: "GET /v1/tasks", Units: 1}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				now.Mono++
				sinkDecision = a.Charge(&req, now, &p, &rec)
			}
			if sinkDecision.Reason != OK {
				b.Fatal(sinkDecision.Reason)
			}
		})
	}
}

// A refunded client id is charged again on retry (the work it paid for
// failed), as the id's next generation; the ledger sees distinct event ids.
func TestRetryAfterRefundIsChargedAgain(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	now := at("2026-06-10T00:00:00Z")
	for gen := uint32(0); gen < 3; gen++ {
		d, rec := charge(a, "job-7", 2, now, &p)
		if d.Reason != OK || rec.Gen != gen || d.Remaining != 8 {
			t.Fatalf("generation %d: %+v gen %d", gen, d, rec.Gen)
		}
		if d, _ := charge(a, "job-7", 2, now, &p); d.Reason != Replayed {
			t.Fatalf("generation %d retried before a refund: %v, want replayed", gen, d.Reason)
		}
		if d := a.Refund("job-7", nil, "", now, &p, &rec); d.Reason != Refunded || rec.Gen != gen {
			t.Fatalf("refund of generation %d: %v (record gen %d)", gen, d.Reason, rec.Gen)
		}
	}
	if LedgerEventID("job-7", 0) != "job-7" || LedgerEventID("job-7", 2) != "job-7\x1f2" {
		t.Fatal("ledger event ids")
	}
	b := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	if err := b.RestoreCheckpoint(a.AppendCheckpoint(nil)); err != nil {
		t.Fatal(err)
	}
	if _, rec := charge(b, "job-7", 2, now, &p); rec.Gen != 3 {
		t.Fatalf("after a checkpoint the next generation is %d, want 3", rec.Gen)
	}
}

// An attempt's refund keeps a charge that a retry was served under, or that
// the id has moved past (a later generation).
func TestRefundAttemptKeepsWhatARetryWasServedUnder(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	now := at("2026-06-10T00:00:00Z")
	var rec Record
	_, crec := charge(a, "k", 2, now, &p)
	receipt := &Receipt{EventID: "k", Gen: crec.Gen, Units: 2, Allocs: append([]Alloc(nil), crec.Allocs...)}
	if d, _ := charge(a, "k", 2, now, &p); d.Reason != Replayed {
		t.Fatalf("retry: %v", d.Reason)
	}
	if d := a.RefundAttempt("k", receipt, "n1", now, &p, &rec); d.Reason != Kept || rec.Type != RecRefund || !rec.Kept || rec.Reserved || d.Remaining != 8 {
		t.Fatalf("the first attempt's refund after a served retry: %+v (record %+v), want kept, logged as Kept", d, rec)
	}
	// The retry failed too (its upstream): taking it back releases the
	// pending refund of the first attempt.
	if d := a.RefundReplay("k", nil, "n1", now, &p, &rec); d.Reason != Refunded || rec.Type != RecRefund || !rec.Released || d.Remaining != 10 {
		t.Fatalf("the replay's refund after the attempt's pending one: %+v (record %+v), want refunded, logged as Released", d, rec)
	}
	// Other order: the replay fails first (kept: nothing pending, the
	// replay counted off in the log), then the attempt's refund applies.
	_, crec = charge(a, "m", 2, now, &p)
	if _, rrec := charge(a, "m", 2, now, &p); rrec.Type != RecReplay || rrec.Delta != 1 || rrec.Gen != crec.Gen {
		t.Fatalf("a replay's record: %+v, want a replay with delta 1", rrec)
	}
	if d := a.RefundReplay("m", nil, "n1", now, &p, &rec); d.Reason != Kept || rec.Type != RecReplay || rec.Delta != -1 || rec.Origin != "" {
		t.Fatalf("a failed replay's refund with the attempt standing: %+v (record %+v), want kept, a replay taken back", d, rec)
	}
	if d := a.RefundAttempt("m", &Receipt{EventID: "m", Gen: crec.Gen, Units: 2}, "n1", now, &p, &rec); d.Reason != Refunded {
		t.Fatalf("the attempt's refund once its replay was taken back: %v, want refunded", d.Reason)
	}
	// Without a retry in between, the attempt's refund applies.
	_, crec = charge(a, "j", 3, now, &p)
	receipt = &Receipt{EventID: "j", Gen: crec.Gen, Units: 3}
	if d := a.RefundAttempt("j", receipt, "n1", now, &p, &rec); d.Reason != Refunded {
		t.Fatalf("an attempt's refund: %v", d.Reason)
	}
	// The id moved on (charged again after that refund): an old attempt's
	// late refund keeps the new generation.
	if _, crec = charge(a, "j", 3, now, &p); crec.Gen != 1 {
		t.Fatalf("gen %d", crec.Gen)
	}
	if d := a.RefundAttempt("j", receipt, "n1", now, &p, &rec); d.Reason != Kept {
		t.Fatalf("a stale attempt's refund of a later generation: %v, want kept", d.Reason)
	}
	// An attempt another node charged (the account moved here since): this
	// node's entry for the id is another attempt's; it stays, and the record
	// only tells the ledger.
	before := a.Usage(now)
	foreign := &Receipt{EventID: "j", Node: "n2", Units: 3, Period: PeriodOf(now.Wall), Allocs: []Alloc{{Grant: MonthlyGrantID(PeriodOf(now.Wall)), Units: 3}}}
	d := a.RefundAttempt("j", foreign, "n1", now, &p, &rec)
	if d.Reason != Refunded || rec.Type != RecRefund || rec.Origin != "n2" || !rec.Attempt || fmt.Sprint(a.Usage(now)) != fmt.Sprint(before) {
		t.Fatalf("a foreign attempt's refund: %+v, record origin %q, usage %+v (was %+v)", d, rec.Origin, a.Usage(now), before)
	}
	b := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	b.ApplyRecord(1, &rec, &p)
	if u := b.Usage(now); u.Used != 0 || u.Remaining != 10 {
		t.Fatalf("replaying a foreign refund changed the state: %+v", u)
	}
}

func TestMonthlyPeriod(t *testing.T) {
	if p, ok := MonthlyPeriod("m:2026-06"); !ok || p != Period(2026*12+5) || MonthlyGrantID(p) != "m:2026-06" {
		t.Errorf("MonthlyPeriod(m:2026-06) = %v, %v", p, ok)
	}
	for _, bad := range []string{"credits", "m:2026-6", "m:june", "2026-06"} {
		if _, ok := MonthlyPeriod(bad); ok {
			t.Errorf("MonthlyPeriod(%q) ok", bad)
		}
	}
}

// A replay is billed once but served again, so it takes a rate-limit token:
// resending one Idempotency-Key does not get around the rate limit.
func TestReplaysTakeRateTokens(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: Plan{ID: "p", MonthlyQuota: 100, Rate: Rate{Tokens: 1, Per: time.Hour}, Burst: 2}})
	now := at("2026-06-10T00:00:00Z")
	want := []Reason{OK, Replayed, RateLimited}
	for i, w := range want {
		if d, _ := charge(a, "k", 1, now, &p); d.Reason != w {
			t.Fatalf("attempt %d of key k with a burst of 2: %s, want %s", i+1, d.Reason, w)
		}
	}
	if u := a.Usage(now); u.Used != 1 {
		t.Fatalf("used %d, want 1 (billed once)", u.Used)
	}
}

// One client id for two routes is a client's mistake, not a retry: replaying
// it would serve an expensive request for a cheap one's units. The second
// route is refused IDReused, charges nothing, takes no rate-limit token, and
// still is after a checkpoint round trip (a restart); the first route still
// replays.
func TestOneIDForTwoRoutesIsRefused(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: Plan{ID: "p", MonthlyQuota: 100, Hard: true, Rate: Rate{Tokens: 1, Per: time.Hour}, Burst: 3}})
	now := at("2026-06-10T00:00:00Z")
	var rec Record
	if d := a.Charge(&Charge{EventID: "k", ClientID: true, Route: "GET /v1/tasks", Units: 1}, now, &p, &rec); d.Reason != OK || d.Remaining != 99 {
		t.Fatalf("first use of key k: %+v", d)
	}
	restored := NewAccount(AccountConfig{ID: "a", Plan: a.Plan()})
	if err := restored.RestoreCheckpoint(a.AppendCheckpoint(nil)); err != nil {
		t.Fatal(err)
	}
	for _, acct := range []*Account{a, restored} {
		for i := 0; i < 3; i++ { // never a token: a burst of 3 holds 2 after the first charge
			d := acct.Charge(&Charge{EventID: "k", ClientID: true, Route: "POST /v1/exports", Units: 25}, now, &p, &rec)
			if d.Reason != IDReused || rec.Type != 0 || d.Remaining != 99 {
				t.Fatalf("key k on another route (try %d): %s, record type %v, remaining %d; want id_reused, no record, 99", i+1, d.Reason, rec.Type, d.Remaining)
			}
		}
		if d := acct.Charge(&Charge{EventID: "k", ClientID: true, Route: "GET /v1/tasks", Units: 1}, now, &p, &rec); d.Reason != Replayed {
			t.Fatalf("key k on its own route: %s, want replayed", d.Reason)
		}
		if d := acct.Charge(&Charge{EventID: "k2", ClientID: true, Route: "POST /v1/exports", Units: 25}, now, &p, &rec); d.Reason != OK || d.Remaining != 74 {
			t.Fatalf("a new key: %+v, want ok with 74 left (the refusals took no token)", d)
		}
	}
}

// The same request (its Target) retried under another route name is a
// retry across a change of the route table, or through a node that has not
// read the change yet: replayed. It was refused IDReused, whose advice (a
// new request needs a new key) ran a timed-out POST's work twice. Without a
// Target, or with another one, another route is still refused.
func TestOneRequestUnderARenamedRouteReplays(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	now := at("2026-06-10T00:00:00Z")
	var rec Record
	if d := a.Charge(&Charge{EventID: "k", ClientID: true, Route: "*", Units: 1, Target: 7}, now, &p, &rec); d.Reason != OK {
		t.Fatalf("first try: %s", d.Reason)
	}
	for _, c := range []struct {
		what   string
		route  string
		target uint64
		want   Reason
	}{
		{"the same request, its route renamed", "POST /v1/reports", 7, Replayed},
		{"another request, another route", "POST /v1/reports", 8, IDReused},
		{"another route, no target", "POST /v1/reports", 0, IDReused},
	} {
		if d := a.Charge(&Charge{EventID: "k", ClientID: true, Route: c.route, Units: 5, Target: c.target}, now, &p, &rec); d.Reason != c.want {
			t.Errorf("%s: %s, want %s", c.what, d.Reason, c.want)
		}
	}
	if u := a.Usage(now); u.Used != 1 {
		t.Errorf("used %d, want 1: a replay is served for the first try's units", u.Used)
	}
}

// A replay is served again for no charge, so one id is served at most
// Params.MaxReplays times over: the next retry is refused ReplayLimit,
// charges nothing, logs nothing and takes no rate-limit token. A replay
// taken back (its upstream failed) frees its place, the count survives a
// restart by checkpoint and by log, and MaxReplays 0 bounds nothing.
func TestReplaysOfOneIDAreBounded(t *testing.T) {
	p := DefaultParams()
	p.MaxReplays = 3
	plan := Plan{ID: "p", MonthlyQuota: 100, Hard: true, Rate: Rate{Tokens: 1, Per: time.Hour}, Burst: 6}
	a := NewAccount(AccountConfig{ID: "a", Plan: plan})
	now := at("2026-06-10T00:00:00Z")
	var rec Record
	var log [][]byte // a's records, encoded as the log holds them
	charge := func(acct *Account) Decision {
		d := acct.Charge(&Charge{EventID: "k", ClientID: true, Route: "*", Units: 5}, now, &p, &rec)
		if rec.Type != 0 && acct == a {
			log = append(log, rec.AppendEncode(nil))
		}
		return d
	}
	if d := charge(a); d.Reason != OK {
		t.Fatal(d.Reason)
	}
	for i := 0; i < 3; i++ {
		if d := charge(a); d.Reason != Replayed {
			t.Fatalf("retry %d: %s, want replayed", i+1, d.Reason)
		}
	}
	d := charge(a)
	if d.Reason != ReplayLimit || rec.Type != 0 || d.Remaining != 95 || !d.Reason.Final() || d.Reason.Accepted() {
		t.Fatalf("retry 4: %s, record type %v, remaining %d; want replay_limit (final), no record, 95 left", d.Reason, rec.Type, d.Remaining)
	}
	// Taking one replay back (its upstream failed) frees its place.
	if d := a.RefundReplay("k", nil, "", now, &p, &rec); d.Reason != Kept || rec.Type != RecReplay || rec.Delta != -1 {
		t.Fatalf("a replay taken back: %s, record type %v, delta %d; want kept, a replay record of -1", d.Reason, rec.Type, rec.Delta)
	}
	log = append(log, rec.AppendEncode(nil))
	if d := charge(a); d.Reason != Replayed {
		t.Fatalf("a retry after one was taken back: %s, want replayed", d.Reason)
	}
	// Restarted by checkpoint and by log: the count is the same.
	byCheckpoint := NewAccount(AccountConfig{ID: "a", Plan: plan})
	if err := byCheckpoint.RestoreCheckpoint(a.AppendCheckpoint(nil)); err != nil {
		t.Fatal(err)
	}
	byLog := NewAccount(AccountConfig{ID: "a", Plan: plan})
	for i := range log {
		var back Record
		if err := back.Decode(log[i]); err != nil {
			t.Fatal(err)
		}
		byLog.ApplyRecord(uint64(i+1), &back, &p)
	}
	for name, r := range map[string]*Account{"live": a, "checkpoint": byCheckpoint, "log": byLog} {
		if d := charge(r); d.Reason != ReplayLimit {
			t.Errorf("%s: retry after 3 served: %s, want replay_limit", name, d.Reason)
		}
		if u := r.Usage(now); u.Used != 5 {
			t.Errorf("%s: used %d, want 5 (billed once)", name, u.Used)
		}
	}
	// The refusals took no token: a burst of 6 less the charge and four
	// replays leaves one for a new key.
	if d := a.Charge(&Charge{EventID: "k2", ClientID: true, Route: "*", Units: 1}, now, &p, &rec); d.Reason != OK {
		t.Fatalf("a new key: %s, want ok", d.Reason)
	}
	p.MaxReplays = 0
	if d := charge(byLog); d.Reason != Replayed {
		t.Fatalf("MaxReplays 0: %s, want replayed (no bound)", d.Reason)
	}
}

// The zero Decision, which comes back with every error, is never accepted:
// a caller that looks at Reason before err must not let an undecided
// request through.
func TestZeroDecisionIsNotAccepted(t *testing.T) {
	var d Decision
	if d.Reason.Accepted() || d.Reason != Undecided || d.Reason.String() != "undecided" {
		t.Fatalf("zero Decision: reason %s, accepted %v; want undecided, not accepted", d.Reason, d.Reason.Accepted())
	}
	if _, ok := d.RetryIn(); ok {
		t.Fatal("the zero Decision says a retry can succeed by waiting")
	}
	for r := Reason(0); int(r) < len(reasonNames); r++ {
		if got, ok := ParseReason(r.String()); !ok || got != r {
			t.Errorf("ParseReason(%q) = %v, %v", r.String(), got, ok)
		}
	}
}

// RetryIn reads RetryAfter as a time.Duration for the refusals that pass
// with time, and says no for the others.
func TestRetryIn(t *testing.T) {
	for _, tc := range []struct {
		d    Decision
		wait time.Duration
		ok   bool
	}{
		{Decision{Reason: RateLimited, RetryAfter: int64(20 * time.Second)}, 20 * time.Second, true},
		{Decision{Reason: QuotaExceeded, RetryAfter: int64(60 * time.Hour)}, 60 * time.Hour, true},
		{Decision{Reason: QuotaExceeded, RetryAfter: Never}, 0, false},
		{Decision{Reason: Invalid}, 0, false},
		{Decision{Reason: UnknownAccount}, 0, false},
		{Decision{Reason: OK}, 0, false},
	} {
		if wait, ok := tc.d.RetryIn(); wait != tc.wait || ok != tc.ok {
			t.Errorf("%s with RetryAfter %d: RetryIn %s, %v; want %s, %v", tc.d.Reason, tc.d.RetryAfter, wait, ok, tc.wait, tc.ok)
		}
	}
}

// A charge above MaxUnits is Invalid and leaves no record: accepted on a
// soft plan (overage), its record would not decode at replay (counts above
// 2^62 read as corrupt) and its usage would wrap around. MaxUnits itself is
// charged and its record round-trips.
func TestChargeAboveMaxUnitsIsInvalid(t *testing.T) {
	p := DefaultParams()
	now := at("2026-06-10T00:00:00Z")
	soft := NewAccount(AccountConfig{ID: "a", Plan: Plan{ID: "soft", MonthlyQuota: 10}})
	for _, units := range []int64{MaxUnits + 1, 1 << 62, math.MaxInt64} {
		if d, rec := charge(soft, fmt.Sprint("big-", units), units, now, &p); d.Reason != Invalid || rec.Type != 0 {
			t.Fatalf("soft plan, %d units: %s with record type %v; want invalid, no record", units, d.Reason, rec.Type)
		}
	}
	d, rec := charge(soft, "max", MaxUnits, now, &p)
	if d.Reason != OK || rec.Type != RecCharge {
		t.Fatalf("soft plan, MaxUnits: %s, want ok", d.Reason)
	}
	var back Record
	if err := back.Decode(rec.AppendEncode(nil)); err != nil || back.Units != MaxUnits {
		t.Fatalf("the record of a MaxUnits charge: %v, units %d", err, back.Units)
	}
}

// At a rollover the previous month's grant stays (its charges may still be
// refunded, see Refundable), with the use it had: a receipt of a June charge
// refunded in July is checked against June's use and returns the units to
// June, never to July. A grant dropped a month early let a receipt claiming
// more than June ever used through.
func TestLastMonthsGrantOutlivesTheRollover(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	june := at("2026-06-30T23:00:00Z")
	var rec Record
	if d := a.Charge(&Charge{EventID: "gen-1", Units: 40, Route: "r"}, june, &p, &rec); d.Reason != OK {
		t.Fatal(d.Reason)
	}
	good := Receipt{EventID: "gen-1", Account: "a", Node: "n1", Units: 40, Period: rec.Period, Wall: rec.Wall, Route: "r", Allocs: slices.Clone(rec.Allocs)}
	july := at("2026-07-01T01:00:00Z")
	if d := a.Charge(&Charge{EventID: "gen-2", Units: 5, Route: "r"}, july, &p, &rec); d.Reason != OK {
		t.Fatal(d.Reason)
	}
	used := func(id string) (int64, bool) {
		for _, g := range a.Grants() {
			if g.ID == id {
				return g.Used, true
			}
		}
		return 0, false
	}
	if u, ok := used("m:2026-06"); !ok || u != 40 {
		t.Fatalf("June's grant in July: used %d, present %v; want 40, kept", u, ok)
	}
	inflated := good
	inflated.Units, inflated.Allocs = 41, []Alloc{{Grant: "m:2026-06", Units: 41}}
	if d := a.Refund("gen-1", &inflated, "n1", july, &p, &rec); d.Reason != Invalid || rec.Type != 0 {
		t.Fatalf("a receipt claiming more than June used: %s, want invalid", d.Reason)
	}
	if d := a.Refund("gen-1", &good, "n1", july, &p, &rec); d.Reason != Refunded || d.MonthUsed != 5 {
		t.Fatalf("June's receipt in July: %+v, want refunded, July's use still 5", d)
	}
	if u, _ := used("m:2026-06"); u != 0 {
		t.Fatalf("June's grant after its refund: used %d, want 0", u)
	}
}

// A refund of last month's charge changes nothing of this month's usage by
// route: the units go back to last month's grant, and this month's routes
// count only this month's charges.
func TestRefundOfLastMonthLeavesThisMonthsRoutes(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	charge(a, "june", 4, at("2026-06-30T23:00:00Z"), &p)
	july := at("2026-07-01T01:00:00Z")
	charge(a, "july", 3, july, &p)
	var rec Record
	if d := a.Refund("june", nil, "", july, &p, &rec); d.Reason != Refunded || d.Units != 4 {
		t.Fatalf("June's charge refunded in July: %+v", d)
	}
	u := a.Usage(july)
	if u.Used != 3 || len(u.Routes) != 1 || u.Routes["GET /x"] != 3 {
		t.Fatalf("July's usage after June's refund: used %d, routes %v; want 3, GET /x: 3", u.Used, u.Routes)
	}
}

// An allowance is never dropped with its grant: a monthly grant long past
// (two rollovers) that still holds units this node reserved stays, so that
// a release hands them back to the ledger. Dropped, they stayed reserved
// there until an operator revoked the node.
func TestAllowanceOnAnOldMonthSurvivesRollovers(t *testing.T) {
	p := DefaultParams()
	p.Reservations = true
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	april := at("2026-04-20T00:00:00Z")
	a.Usage(april)
	var rec Record
	if !a.Reserve("m:2026-04", 7, april, &rec) {
		t.Fatal("no April grant to reserve on")
	}
	june := at("2026-06-02T00:00:00Z")
	if d, _ := charge(a, "e", 1, june, &p); d.Reason != NeedReservation {
		t.Fatalf("a June charge with no June allowance: %s, want need_reservation", d.Reason)
	}
	if got := a.Allowances(); !slices.Equal(got, []Alloc{{Grant: "m:2026-04", Units: 7}}) {
		t.Fatalf("allowances in June: %v, want April's 7 still to release", got)
	}
}

// The dedup window is one rule, whatever order the ids sit in: an id is
// remembered while younger than the window and forgotten at exactly the
// window, even when expire cannot drop it yet because an id renewed in
// place (a refunded id charged again) sits younger at the head of the queue.
func TestIDIsForgottenAtExactlyTheWindow(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	t0 := at("2026-06-10T00:00:00Z")
	later := func(d time.Duration) Now { return Now{Wall: t0.Wall + int64(d), Mono: t0.Mono + int64(d)} }
	charge(a, "x", 1, t0, &p)
	charge(a, "y", 1, later(time.Second), &p)
	var rec Record
	if d := a.Refund("x", nil, "", later(2*time.Hour), &p, &rec); d.Reason != Refunded {
		t.Fatal(d.Reason)
	}
	if d, _ := charge(a, "x", 1, later(2*time.Hour), &p); d.Reason != OK {
		t.Fatalf("x charged again: %s", d.Reason)
	}
	if d, _ := charge(a, "y", 1, later(24*time.Hour+time.Second-1), &p); d.Reason != Replayed {
		t.Fatalf("y a nanosecond inside the window: %s, want replayed", d.Reason)
	}
	if d, rec := charge(a, "y", 1, later(24*time.Hour+time.Second), &p); d.Reason != OK || rec.Type != RecCharge {
		t.Fatalf("y exactly a window old: %s, want a new charge", d.Reason)
	}
}

// The dedup memory is bounded at DedupMax ids: the oldest beyond it is
// forgotten, and its retry is a new charge.
func TestDedupMemoryHoldsAtMostDedupMax(t *testing.T) {
	p := DefaultParams()
	p.DedupMax = 2
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	now := at("2026-06-10T00:00:00Z")
	for _, id := range []string{"a", "b", "c"} {
		if d, _ := charge(a, id, 1, now, &p); d.Reason != OK {
			t.Fatal(d.Reason)
		}
	}
	if d, _ := charge(a, "c", 1, now, &p); d.Reason != Replayed {
		t.Fatalf("the newest id again: %s, want replayed", d.Reason)
	}
	if d, rec := charge(a, "a", 1, now, &p); d.Reason != OK || rec.Type != RecCharge {
		t.Fatalf("the oldest of three ids with room for two: %s, want a new charge", d.Reason)
	}
}

// A refund by receipt survives a restart: rebuilt from its records, the
// account remembers the generated id as refunded, and the same receipt
// again answers AlreadyRefunded and returns nothing (G4). Forgotten, the
// second refund went through whenever the grant's use still covered it.
func TestRefundByReceiptSurvivesRecovery(t *testing.T) {
	p := DefaultParams()
	cfg := AccountConfig{ID: "a", Plan: hardPlan(100)}
	a := NewAccount(cfg)
	now := at("2026-06-10T00:00:00Z")
	var log recordLog
	var rec Record
	var rc *Receipt
	for _, id := range []string{"gen-1", "gen-2"} {
		if d := a.Charge(&Charge{EventID: id, Units: 40, Route: "r"}, now, &p, &rec); d.Reason != OK {
			t.Fatal(d.Reason)
		}
		log = append(log, rec)
		if rc == nil {
			rc = &Receipt{EventID: id, Account: "a", Node: "n1", Units: 40, Period: rec.Period, Wall: rec.Wall, Route: "r", Allocs: slices.Clone(rec.Allocs)}
		}
		rec = Record{}
	}
	if d := a.Refund("gen-1", rc, "n1", now, &p, &rec); d.Reason != Refunded {
		t.Fatal(d.Reason)
	}
	log = append(log, rec)
	b := log.rebuild(t, cfg, &p)
	if d := b.Refund("gen-1", rc, "n1", now, &p, &rec); d.Reason != AlreadyRefunded || rec.Type != 0 || d.MonthUsed != 40 {
		t.Fatalf("the receipt again after a restart: %+v (record %v), want already_refunded, used 40", d, rec.Type)
	}
}

// Units the ledger reserves end a grant's exhausted backoff: the ledger
// had more after all (another node handed some back), so a charge short
// of the new allowance asks again (NeedReservation) instead of being
// refused for the quota until the backoff ends.
func TestReservationEndsTheExhaustedBackoff(t *testing.T) {
	p, now, june := reservationsOn10June()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	a.MarkExhausted(june, now.Mono+int64(time.Hour))
	if d, _ := charge(a, "e1", 3, now, &p); d.Reason != QuotaExceeded {
		t.Fatalf("exhausted, nothing reserved: %v", d.Reason)
	}
	var rec Record
	if !a.Reserve(june, 2, now, &rec) {
		t.Fatal("reserve failed")
	}
	if d, _ := charge(a, "e1", 3, now, &p); d.Reason != NeedReservation || d.Shortfall != 1 {
		t.Fatalf("2 reserved since, a charge of 3: %+v; want need_reservation short by 1", d)
	}
}

// A plan whose burst is lowered applies at once: the bucket holds no more
// than the new burst, even before any time has passed.
func TestLowerBurstAppliesAtOnce(t *testing.T) {
	p := DefaultParams()
	now := at("2026-06-10T00:00:00Z")
	plan := Plan{ID: "p", Rate: Rate{Tokens: 1, Per: time.Second}, Burst: 10}
	a := NewAccount(AccountConfig{ID: "a", Plan: plan})
	if d, _ := charge(a, "e0", 0, now, &p); d.Reason != OK || d.RateRemaining != 9 {
		t.Fatalf("first request: %+v", d)
	}
	plan.Burst = 2
	a.Configure(AccountConfig{ID: "a", Plan: plan})
	for i := range 3 {
		d, _ := charge(a, fmt.Sprint("e", i+1), 0, now, &p)
		if want := map[bool]Reason{true: OK, false: RateLimited}[i < 2]; d.Reason != want {
			t.Fatalf("request %d after the burst went down to 2: %s, want %s", i+1, d.Reason, want)
		}
	}
}

// With two retries served under a charge, its attempt's refund is held
// until both are taken back: the first take-back keeps the charge (the
// other retry may have been served), the second releases it. Asked twice,
// the attempt's refund is held once: the second ask answers Kept and logs
// nothing more.
func TestPendingRefundWaitsForEveryReplay(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	now := at("2026-06-10T00:00:00Z")
	var rec Record
	_, crec := charge(a, "k", 2, now, &p)
	receipt := &Receipt{EventID: "k", Gen: crec.Gen, Units: 2, Allocs: slices.Clone(crec.Allocs)}
	for i := range 2 {
		if d, _ := charge(a, "k", 2, now, &p); d.Reason != Replayed {
			t.Fatalf("retry %d: %v", i+1, d.Reason)
		}
	}
	if d := a.RefundAttempt("k", receipt, "n1", now, &p, &rec); d.Reason != Kept || rec.Type != RecRefund || !rec.Kept {
		t.Fatalf("the attempt's refund with two retries out: %+v (record %v)", d, rec.Type)
	}
	if d := a.RefundAttempt("k", receipt, "n1", now, &p, &rec); d.Reason != Kept || rec.Type != 0 {
		t.Fatalf("the attempt's refund asked again: %s (record %v), want kept, nothing logged", d.Reason, rec.Type)
	}
	if d := a.RefundReplay("k", nil, "n1", now, &p, &rec); d.Reason != Kept || rec.Type != RecReplay || d.Remaining != 8 {
		t.Fatalf("the first retry taken back, the second still out: %+v (record %v), want kept", d, rec.Type)
	}
	if d := a.RefundReplay("k", nil, "n1", now, &p, &rec); d.Reason != Refunded || !rec.Released || d.Remaining != 10 {
		t.Fatalf("the last retry taken back: %+v (record %+v), want the pending refund released", d, rec)
	}
}

// In reservations mode a refund gives the units back to this node's
// allowance, and its record says so (Reserved), so that the ledger returns
// them to the node's reservation: spent again, they need no new round trip.
// Returned to the grant only, they were lost to this node, and the next
// charges waited for the ledger again.
// A refund in reservations mode gives its units back to the grant in the
// ledger, not to this node's allowance: a refund that the ledger finds to be
// a duplicate (two owners refunding one event during a handoff) must leave
// nothing here to spend (G1). The grant is no longer known to be exhausted:
// the next charge short of units asks the ledger, which has them once the
// refund settles.
func TestRefundReturnsUnitsToTheLedger(t *testing.T) {
	p, now, june := reservationsOn10June()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	var rec Record
	a.Reserve(june, 10, now, &rec)
	if d, _ := charge(a, "e1", 10, now, &p); d.Reason != OK {
		t.Fatalf("charge: %v", d.Reason)
	}
	a.MarkExhausted(june, now.Mono+int64(time.Hour))
	if d, _ := charge(a, "e2", 1, now, &p); d.Reason != QuotaExceeded {
		t.Fatalf("a charge with the grant exhausted in the ledger: %v, want quota exceeded", d.Reason)
	}
	d := a.Refund("e1", nil, "", now, &p, &rec)
	if d.Reason != Refunded || rec.Reserved || rec.Units != 10 {
		t.Fatalf("refund: %v, %d units, record reserved %v; want refunded, 10 units, not reserved", d.Reason, rec.Units, rec.Reserved)
	}
	if got := a.Allowances(); !slices.Equal(got, []Alloc{{Grant: june, Units: 0}}) && len(got) != 0 {
		t.Fatalf("allowance after the refund: %v, want nothing: the units went back to the ledger", got)
	}
	if d, _ := charge(a, "e3", 4, now, &p); d.Reason != NeedReservation || d.Shortfall != 4 {
		t.Fatalf("a charge after the refund: %v short %d, want a reservation of 4 asked for (the refund's units are the ledger's)", d.Reason, d.Shortfall)
	}
	// Recovery applies the refund record the same way.
	b := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	var r2 Record
	b.Reserve(june, 10, now, &r2)
	chargeRec := Record{Type: RecCharge, Account: "a", EventID: "e1", ClientID: true, Units: 10, Period: PeriodOf(now.Wall), Wall: now.Wall, Reserved: true,
		Allocs: []Alloc{{Grant: june, Units: 10}}}
	b.ApplyRecord(1, &chargeRec, &p)
	b.ApplyRecord(2, &rec, &p)
	if got := b.Allowance(now.Wall); got != 0 {
		t.Fatalf("allowance after recovering the refund: %d, want 0", got)
	}
	if g := b.Grants(); len(g) != 1 || g[0].Used != 0 || g[0].Allowance != 0 {
		t.Fatalf("grants after recovering the refund: %+v, want used 0, allowance 0", g)
	}
}

// An attempt's refund of a charge another node made (the account moved
// here since) lowers the use this owner counts, in reservations mode: the
// use it was seeded with from the ledger counts that charge, and kept, the
// refunded units stayed used here until the account moved again, so a hard
// account at its quota was refused units the ledger had free. Recovery
// replays it the same way.
func TestForeignAttemptRefundLowersTheUse(t *testing.T) {
	p, now, june := reservationsOn10June()
	cfg := AccountConfig{ID: "a", Plan: hardPlan(10), MonthlyUsed: map[string]int64{june: 10}}
	a := NewAccount(cfg)
	a.MarkExhausted(june, now.Mono+int64(time.Hour))
	if d, _ := charge(a, "x", 1, now, &p); d.Reason != QuotaExceeded {
		t.Fatalf("a charge with the quota used up: %v, want quota exceeded", d.Reason)
	}
	var rec Record
	foreign := &Receipt{EventID: "e1", Account: "a", Node: "n2", Units: 4, Period: PeriodOf(now.Wall), Allocs: []Alloc{{Grant: june, Units: 4}}}
	d := a.RefundAttempt("e1", foreign, "n1", now, &p, &rec)
	if d.Reason != Refunded || rec.Origin != "n2" || d.Remaining != 4 {
		t.Fatalf("a foreign attempt's refund: %+v, origin %q; want refunded, 4 left, origin n2", d, rec.Origin)
	}
	if d, _ := charge(a, "y", 4, now, &p); d.Reason != NeedReservation || d.Shortfall != 4 {
		t.Fatalf("a charge of the refunded units: %v short %d, want a reservation of 4 asked for", d.Reason, d.Shortfall)
	}
	b := NewAccount(cfg)
	b.ApplyRecord(1, &rec, &p)
	if u := b.Usage(now); u.Remaining != 4 {
		t.Fatalf("after replaying the refund: %+v, want 4 left", u)
	}
}

// A soft plan's month takes at most MaxMonthUse units: its overage had no
// bound, and past int64 the month's use read 0 again (the floor at 0)
// while the ledger refused every settle of the batch (Postgres: bigint out
// of range) or stored a float that broke every snapshot read (SQLite).
func TestSoftMonthUseIsBounded(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: Plan{ID: "soft", MonthlyQuota: 1000}})
	now := at("2026-06-10T00:00:00Z")
	var rec Record
	for i := range MaxMonthUse / MaxUnits {
		if d := a.Charge(&Charge{EventID: fmt.Sprintf("e%d", i), Route: "r", Units: MaxUnits}, now, &p, &rec); d.Reason != OK {
			t.Fatalf("charge %d of %d units: %s", i, int64(MaxUnits), d.Reason)
		}
	}
	d := a.Charge(&Charge{EventID: "one-more", Route: "r", Units: 1}, now, &p, &rec)
	if d.Reason != QuotaExceeded || rec.Type != 0 {
		t.Fatalf("a charge past %d units in a month: %s (record type %d), want quota_exceeded, nothing logged", int64(MaxMonthUse), d.Reason, rec.Type)
	}
	if d.MonthUsed != MaxMonthUse {
		t.Errorf("month used %d, want %d", d.MonthUsed, int64(MaxMonthUse))
	}
}

// A receipt can be refunded in its charge's month and the next
// (Refundable), and it is refunded once over all that time: the memory
// of receipts refunded lasted the dedup window only (24 h), after which
// the same receipt was refunded again (with --events=false, the ledger
// credited the grant twice). A client id refunded by id is refused by its
// receipt after its dedup entry has gone, too; and its next generation,
// charged again after the refund, can still be refunded.
func TestReceiptRefundedOnceWhileRefundable(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(1000)})
	now := at("2026-06-10T00:00:00Z")
	later := Now{Wall: now.Wall + int64(25*time.Hour), Mono: now.Mono + int64(25*time.Hour)}
	muchLater := Now{Wall: at("2026-07-30T00:00:00Z").Wall, Mono: now.Mono + int64(50*24*time.Hour)}
	var rec Record
	receipt := func(id string, gen uint32) *Receipt {
		return &Receipt{EventID: id, Account: "a", Node: "n1", Units: rec.Units, Period: rec.Period, Wall: rec.Wall, Route: "r", Gen: gen,
			Allocs: append([]Alloc(nil), rec.Allocs...)}
	}
	a.Charge(&Charge{EventID: "gen-1", Route: "r", Units: 10}, now, &p, &rec)
	generated := receipt("gen-1", 0)
	a.Charge(&Charge{EventID: "key-1", ClientID: true, Route: "r", Units: 10}, now, &p, &rec)
	client := receipt("key-1", 0)
	a.Charge(&Charge{EventID: "other", Route: "r", Units: 50}, now, &p, &rec)

	if d := a.Refund("gen-1", generated, "n1", now, &p, &rec); d.Reason != Refunded {
		t.Fatalf("first refund of a receipt: %s", d.Reason)
	}
	if d := a.Refund("key-1", nil, "n1", now, &p, &rec); d.Reason != Refunded {
		t.Fatalf("refund of a client id: %s", d.Reason)
	}
	for _, when := range []Now{later, muchLater} {
		if d := a.Refund("gen-1", generated, "n1", when, &p, &rec); d.Reason != AlreadyRefunded {
			t.Errorf("the same receipt refunded again %s later: %s, want already_refunded", time.Duration(when.Wall-now.Wall), d.Reason)
		}
		if d := a.Refund("key-1", client, "n1", when, &p, &rec); d.Reason != AlreadyRefunded {
			t.Errorf("a client id refunded by id, then by its receipt %s later: %s, want already_refunded", time.Duration(when.Wall-now.Wall), d.Reason)
		}
	}
	// The client id's next generation is a charge of its own.
	a.Charge(&Charge{EventID: "key-2", ClientID: true, Route: "r", Units: 5}, now, &p, &rec)
	a.Refund("key-2", nil, "n1", now, &p, &rec)
	a.Charge(&Charge{EventID: "key-2", ClientID: true, Route: "r", Units: 5}, now, &p, &rec)
	if rec.Gen != 1 {
		t.Fatalf("key-2 charged again after its refund: generation %d, want 1", rec.Gen)
	}
	next := receipt("key-2", 1)
	if d := a.Refund("key-2", next, "n1", later, &p, &rec); d.Reason != Refunded {
		t.Errorf("key-2's second generation refunded by its receipt after the dedup window: %s, want refunded", d.Reason)
	}
}

// An attempt's refund of another node's charge applies once: repeated (the
// front retries a refund whose reply was lost), it lowered the use again
// and logged another refund. Once per node's attempt, and after a replay
// of the log too.
func TestRefundOfAnotherNodesChargeOnce(t *testing.T) {
	p := DefaultParams()
	p.Reservations = true
	a := NewAccount(AccountConfig{ID: "a", Plan: Plan{ID: "soft", MonthlyQuota: 1000}})
	now := at("2026-06-10T00:00:00Z")
	var rec Record
	a.Charge(&Charge{EventID: "other", Route: "r", Units: 50}, now, &p, &rec)
	grant := MonthlyGrantID(rec.Period)
	receipt := func(node string) *Receipt {
		return &Receipt{EventID: "job", Account: "a", Node: node, Units: 10, Period: rec.Period, Wall: rec.Wall, Route: "r",
			Allocs: []Alloc{{Grant: grant, Units: 10}}}
	}
	if d := a.RefundAttempt("job", receipt("n2"), "n1", now, &p, &rec); d.Reason != Refunded || rec.Type != RecRefund {
		t.Fatalf("first refund of n2's attempt: %s (record %d)", d.Reason, rec.Type)
	}
	logged := rec
	logged.Allocs = slices.Clone(rec.Allocs)
	if d := a.RefundAttempt("job", receipt("n2"), "n1", now, &p, &rec); d.Reason != AlreadyRefunded || rec.Type != 0 {
		t.Errorf("the same refund again: %s (record %d), want already_refunded, nothing logged", d.Reason, rec.Type)
	}
	if d := a.RefundAttempt("job", receipt("n3"), "n1", now, &p, &rec); d.Reason != Refunded {
		t.Errorf("n3's attempt of the same id: %s, want refunded (an attempt of its own)", d.Reason)
	}
	// Replayed from the log (a restart), the first is remembered too.
	b := NewAccount(AccountConfig{ID: "a", Plan: Plan{ID: "soft", MonthlyQuota: 1000}})
	b.ApplyRecord(1, &logged, &p)
	if d := b.RefundAttempt("job", receipt("n2"), "n1", now, &p, &rec); d.Reason != AlreadyRefunded {
		t.Errorf("after a replay of the log: %s, want already_refunded", d.Reason)
	}
}

// A client id used again after its dedup window (a new charge, at
// generation 0 again) can be refunded by its receipt: the memory of the
// first charge's refund named the id only, and answered already_refunded.
func TestReusedIDRefundedByReceipt(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(1000)})
	t0 := at("2026-06-10T00:00:00Z")
	step := func(h int) Now {
		return Now{Wall: t0.Wall + int64(h)*int64(time.Hour), Mono: t0.Mono + int64(h)*int64(time.Hour)}
	}
	var rec Record
	a.Charge(&Charge{EventID: "order-7", ClientID: true, Route: "r", Units: 10}, t0, &p, &rec)
	if d := a.Refund("order-7", nil, "n1", t0, &p, &rec); d.Reason != Refunded {
		t.Fatalf("first refund: %s", d.Reason)
	}
	if d := a.Charge(&Charge{EventID: "order-7", ClientID: true, Route: "r", Units: 10}, step(25), &p, &rec); d.Reason != OK {
		t.Fatalf("the reused id: %s", d.Reason)
	}
	receipt := &Receipt{EventID: "order-7", Account: "a", Node: "n1", Units: rec.Units, Period: rec.Period, Wall: rec.Wall, Route: "r", Gen: rec.Gen,
		Allocs: append([]Alloc(nil), rec.Allocs...)}
	if d := a.Refund("order-7", receipt, "n1", step(75), &p, &rec); d.Reason != Refunded {
		t.Fatalf("the second charge's refund by its receipt: %s, want refunded", d.Reason)
	}
	if d := a.Refund("order-7", receipt, "n1", step(76), &p, &rec); d.Reason != AlreadyRefunded {
		t.Fatalf("that receipt again: %s, want already_refunded", d.Reason)
	}
}

// A plan's rate period changed mid-month: the bucket's credit is counted
// in the old period's unit, and was read in the new one. 10/m with one
// token left, changed to 10/s, had 10 tokens (one burst more than it had);
// 10/s full, changed to 10/m, had a sixth of a token (a burst less).
func TestRatePeriodChangeKeepsTheTokensLeft(t *testing.T) {
	p := DefaultParams()
	perMinute := Plan{ID: "r", Rate: Rate{Tokens: 10, Per: time.Minute}, Burst: 10}
	perSecond := Plan{ID: "r", Rate: Rate{Tokens: 10, Per: time.Second}, Burst: 10}
	now := at("2026-06-10T00:00:00Z")
	a := NewAccount(AccountConfig{ID: "a", Plan: perMinute})
	for i := 0; i < 9; i++ {
		if d, _ := charge(a, fmt.Sprint("m", i), 1, now, &p); d.Reason != OK {
			t.Fatalf("charge %d at 10/m: %v", i, d.Reason)
		}
	}
	a.Configure(AccountConfig{ID: "a", Plan: perSecond})
	if d, _ := charge(a, "s0", 1, now, &p); d.Reason != OK || d.RateRemaining != 0 {
		t.Fatalf("the token left, after 10/m became 10/s: %+v, want ok and 0 left", d)
	}
	if d, _ := charge(a, "s1", 1, now, &p); d.Reason != RateLimited {
		t.Fatalf("a second charge at the same instant after 10/m became 10/s: %v, want rate_limited (one token was left)", d.Reason)
	}

	b := NewAccount(AccountConfig{ID: "b", Plan: perSecond})
	if d, _ := charge(b, "s0", 1, now, &p); d.Reason != OK || d.RateRemaining != 9 {
		t.Fatalf("first charge at 10/s: %+v", d)
	}
	b.Configure(AccountConfig{ID: "b", Plan: perMinute})
	for i := 0; i < 9; i++ {
		if d, _ := charge(b, fmt.Sprint("m", i), 1, now, &p); d.Reason != OK {
			t.Fatalf("charge %d of the 9 tokens left, after 10/s became 10/m: %v", i, d.Reason)
		}
	}
	if d, _ := charge(b, "m9", 1, now, &p); d.Reason != RateLimited {
		t.Fatalf("a tenth charge after 10/s became 10/m: %v, want rate_limited", d.Reason)
	}
}

// An upgrade right after the ledger called the month exhausted: the mark
// (a second, so that refusals do not each ask the ledger) outlived the
// plan it was about, and the account was refused with Retry-After to the
// month's end though its new quota had room. A credit bought then too.
func TestUpgradeForgetsTheExhaustedMark(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  AccountConfig
	}{
		{"larger quota", AccountConfig{ID: "a", Plan: hardPlan(20)}},
		{"a larger credit", AccountConfig{ID: "a", Plan: hardPlan(10), Credits: []GrantConfig{{ID: "c1", Units: 5}}}},
	} {
		p, now, june := reservationsOn10June()
		a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10), Credits: []GrantConfig{{ID: "c1", Units: 1}}})
		var rec Record
		a.Reserve(june, 10, now, &rec)
		a.Reserve("c1", 1, now, &rec)
		if d, _ := charge(a, "e1", 11, now, &p); d.Reason != OK {
			t.Fatalf("%s: the whole quota and credit: %v", c.name, d.Reason)
		}
		a.MarkExhausted(june, now.Mono+int64(time.Second))
		a.MarkExhausted("c1", now.Mono+int64(time.Second))
		if d, _ := charge(a, "e2", 1, now, &p); d.Reason != QuotaExceeded {
			t.Fatalf("%s: exhausted before the upgrade: %v", c.name, d.Reason)
		}
		a.Configure(c.cfg)
		if d, _ := charge(a, "e3", 1, now, &p); d.Reason != NeedReservation {
			t.Fatalf("%s: a charge right after the upgrade: %+v, want need_reservation (ask the ledger for the new units)", c.name, d)
		}
	}
}

// A reseed (an account regained or restored) sets the use to the
// ledger's; the use the ledger showed that this owner never counted
// (unseen, other nodes' unsettled charges) is still unseen. It went
// down by the whole settled figure, and the account showed 50 left of
// 100 where the ledger had 10.
func TestReseedKeepsTheUseNotSeenHere(t *testing.T) {
	p, now, june := reservationsOn10June()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(100)})
	var rec Record
	a.Reserve(june, 50, now, &rec)
	if d, _ := charge(a, "e1", 40, now, &p); d.Reason != OK {
		t.Fatalf("charge: %v", d.Reason)
	}
	a.MarkExhausted(june, now.Mono+int64(time.Second)) // the ledger: 90 used or reserved
	if u := a.Usage(now); u.Remaining != 10 {
		t.Fatalf("before the reseed: %d left, want 10", u.Remaining)
	}
	a.Configure(AccountConfig{ID: "a", Plan: hardPlan(100), MonthlyUsed: map[string]int64{june: 40}, Reseed: true})
	if u := a.Usage(now); u.Remaining != 10 {
		t.Fatalf("after a reseed at the settled 40: %d left, want 10 (the 50 the ledger showed that this owner never counted are still unseen)", u.Remaining)
	}
	a.Configure(AccountConfig{ID: "a", Plan: hardPlan(100), MonthlyUsed: map[string]int64{june: 30}, Reseed: true})
	if u := a.Usage(now); u.Remaining != 20 {
		t.Fatalf("after a reseed at 30 (a refund settled elsewhere): %d left, want 20", u.Remaining)
	}
}

// This node's replay taken back after the node forgot the id (the account
// let go and come back: ForgetIDs, or dropped and seeded again): it was
// answered UnknownEvent and logged nothing, so the ledger never counted
// the replay off and the refund it held pending (the attempt failed too)
// was never applied: billed, though nothing was served. The take-back goes
// to the ledger as another node's does.
func TestReplayTakenBackAfterTheIDWasForgotten(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	now := at("2026-06-10T00:00:00Z")
	_, crec := charge(a, "k", 2, now, &p)
	receipt := &Receipt{EventID: "k", Node: "n1", Gen: crec.Gen, Units: 2, Period: crec.Period}
	if d, _ := charge(a, "k", 2, now, &p); d.Reason != Replayed {
		t.Fatalf("retry: %v", d.Reason)
	}
	var rec Record
	if d := a.RefundAttempt("k", receipt, "n1", now, &p, &rec); d.Reason != Kept {
		t.Fatalf("the attempt's refund with a replay out: %+v", d)
	}
	a.ForgetIDs()
	if d := a.RefundReplay("k", receipt, "n1", now, &p, &rec); d.Reason != Kept || rec.Type != RecReplay || rec.Delta != -1 || rec.Gen != crec.Gen || rec.Period != crec.Period {
		t.Fatalf("the replay taken back once the id was forgotten: %+v (record %+v), want Kept and a take-back record for the ledger", d, rec)
	}
	// Without a receipt there is nothing to name: unknown, as before.
	if d := a.RefundReplay("k", nil, "n1", now, &p, &rec); d.Reason != UnknownEvent || rec.Type != 0 {
		t.Fatalf("a take-back with no receipt once the id was forgotten: %+v (record %+v), want UnknownEvent and nothing logged", d, rec)
	}
}

// An account back from another owner counts by route what this owner
// charges from then on (ForgetRoutes): a refund of a charge from before
// (its receipt still refunds it) leaves the route at zero, not below, and
// the month's use is the grant's.
func TestRefundOfAChargeBeforeTheRoutesWereForgotten(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(10)})
	now := at("2026-06-10T00:00:00Z")
	_, crec := charge(a, "k", 4, now, &p)
	receipt := &Receipt{EventID: "k", Node: "n1", Gen: crec.Gen, Units: 4, Period: crec.Period, Route: "GET /x", Allocs: crec.Allocs}
	a.ForgetIDs()
	a.ForgetRoutes()
	charge(a, "k2", 1, now, &p)
	var rec Record
	if d := a.Refund("k", receipt, "n1", now, &p, &rec); d.Reason != Refunded {
		t.Fatalf("refund by receipt of a charge from before: %+v", d)
	}
	if u := a.Usage(now); u.Routes["GET /x"] != 0 || u.Used != 1 {
		t.Errorf("usage after the refund: %+v; want GET /x at 0 (not below) and 1 used (k2)", u)
	}
}
