package shard

import (
	"slices"
	"testing"
)

// (From a review of G3/G4.) A client id used in June and again in July (generation 0 both times: the
// generations start again each month). The June use is refunded by its
// receipt in July. Live, that refund returns June's charge and leaves the
// July one standing; rebuilt from the same records (a restart before a
// checkpoint covers them), the refund record marks the July charge refunded.
func TestAReceiptRefundOfLastMonthsUseReplaysOntoItsOwnCharge(t *testing.T) {
	p := DefaultParams()
	cfg := AccountConfig{ID: "a", Plan: hardPlan(1000)}
	a := NewAccount(cfg)
	var log recordLog
	var rec Record
	june := at("2026-06-10T00:00:00Z")
	if d := a.Charge(&Charge{EventID: "K", ClientID: true, Route: "r", Units: 10}, june, &p, &rec); d.Reason != OK {
		t.Fatal(d.Reason)
	}
	log.keep(rec)
	juneReceipt := &Receipt{EventID: "K", Account: "a", Node: "n1", Gen: rec.Gen, Units: rec.Units, Period: rec.Period, Wall: rec.Wall, Route: "r", Allocs: slices.Clone(rec.Allocs)}
	rec = Record{}
	july := at("2026-07-15T00:00:00Z")
	if d := a.Charge(&Charge{EventID: "K", ClientID: true, Route: "r", Units: 7}, july, &p, &rec); d.Reason != OK || rec.Gen != juneReceipt.Gen {
		t.Fatalf("july use: %v gen %d", d.Reason, rec.Gen)
	}
	log.keep(rec)
	rec = Record{}
	later := at("2026-07-15T01:00:00Z")
	if d := a.Refund("K", juneReceipt, "n1", later, &p, &rec); d.Reason != Refunded || rec.Units != 10 {
		t.Fatalf("june refund by receipt: %+v", d)
	}
	log.keep(rec)

	b := log.rebuild(t, cfg, &p)
	retry := at("2026-07-15T02:00:00Z")
	var r1, r2 Record
	live := a.Charge(&Charge{EventID: "K", ClientID: true, Route: "r", Units: 7}, retry, &p, &r1)
	rebuilt := b.Charge(&Charge{EventID: "K", ClientID: true, Route: "r", Units: 7}, retry, &p, &r2)
	t.Logf("retry of July's K: live %v (record %v gen %d), after restart %v (record %v gen %d)", live.Reason, r1.Type, r1.Gen, rebuilt.Reason, r2.Type, r2.Gen)
	if live.Reason != rebuilt.Reason {
		t.Errorf("retry of July's charge: live %v, after replay %v (a second charge, billed as K gen %d)", live.Reason, rebuilt.Reason, r2.Gen)
	}
	var f1, f2 Record
	dl := a.Refund("K", nil, "n1", retry, &p, &f1)
	db := b.Refund("K", nil, "n1", retry, &p, &f2)
	if dl.Reason != db.Reason {
		t.Errorf("refund of July's K by id: live %v, after replay %v", dl.Reason, db.Reason)
	}
}

// K was used on 10 June at node n1; the account moved to n2, where K was
// used again on 15 July (new work: generation 0 of July). A refund of the
// June use by its receipt (n1's) at n2 should return June's 10 units; it
// refunds July's use, which nobody asked to refund.
func TestAnotherNodesReceiptOfAnEarlierUseRefundsThatUse(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(1000)})
	june := at("2026-06-10T00:00:00Z")
	juneReceipt := &Receipt{EventID: "K", Account: "a", Node: "n1", Gen: 0, Units: 10, Period: PeriodOf(june.Wall), Wall: june.Wall, Route: "r",
		Allocs: []Alloc{{Grant: MonthlyGrantID(PeriodOf(june.Wall)), Units: 10}}}
	var rec Record
	july := at("2026-07-15T00:00:00Z")
	if d := a.Charge(&Charge{EventID: "K", ClientID: true, Route: "r", Units: 7}, july, &p, &rec); d.Reason != OK {
		t.Fatal(d.Reason)
	}
	rec = Record{}
	d := a.Refund("K", juneReceipt, "n2", at("2026-07-15T01:00:00Z"), &p, &rec)
	t.Logf("refund by June's receipt: %v, record units %d period %s", d.Reason, rec.Units, rec.Period)
	if rec.Period != juneReceipt.Period || rec.Units != 10 {
		t.Errorf("refunded %d units of %s, want June's 10", rec.Units, rec.Period)
	}
	var r2 Record
	if retry := a.Charge(&Charge{EventID: "K", ClientID: true, Route: "r", Units: 7}, at("2026-07-15T02:00:00Z"), &p, &r2); retry.Reason != Replayed {
		t.Errorf("retry of July's K after June's refund: %v (gen %d), want replayed", retry.Reason, r2.Gen)
	}
}

// K charged on 2 June and refunded; K used again on 12 June (new work:
// the refunded generation 0 is taken over, per nextGen). The 2 June
// receipt's refund sent again (a lost answer, a client's retry) must
// change nothing; it refunds the 12 June charge.
func TestAReceiptRefundedTwiceDoesNotRefundTheIDsNextUse(t *testing.T) {
	p := DefaultParams()
	a := NewAccount(AccountConfig{ID: "a", Plan: hardPlan(1000)})
	var rec Record
	d2 := at("2026-06-02T00:00:00Z")
	if d := a.Charge(&Charge{EventID: "K", ClientID: true, Route: "r", Units: 10}, d2, &p, &rec); d.Reason != OK {
		t.Fatal(d.Reason)
	}
	first := &Receipt{EventID: "K", Account: "a", Node: "n1", Gen: rec.Gen, Units: rec.Units, Period: rec.Period, Wall: rec.Wall, Route: "r", Allocs: slices.Clone(rec.Allocs)}
	rec = Record{}
	if d := a.Refund("K", first, "n1", at("2026-06-02T00:01:00Z"), &p, &rec); d.Reason != Refunded {
		t.Fatal(d.Reason)
	}
	rec = Record{}
	if d := a.Charge(&Charge{EventID: "K", ClientID: true, Route: "r", Units: 7}, at("2026-06-12T00:00:00Z"), &p, &rec); d.Reason != OK {
		t.Fatal(d.Reason)
	}
	t.Logf("12 June use: gen %d", rec.Gen)
	rec = Record{}
	d := a.Refund("K", first, "n1", at("2026-06-12T00:05:00Z"), &p, &rec)
	t.Logf("2 June receipt again: %v, record %v units %d", d.Reason, rec.Type, rec.Units)
	if d.Reason != AlreadyRefunded {
		t.Errorf("the 2 June receipt refunded again: %v (%d units, the 12 June charge's)", d.Reason, rec.Units)
	}
	if u := a.Usage(at("2026-06-12T00:05:00Z")); u.Used != 7 {
		t.Errorf("used %d, want 7 (12 June's charge stands)", u.Used)
	}
}
