package router

import (
	"reflect"
	"testing"

	"github.com/quotaring/quotaring/shard"
)

// fillNonZero sets every int, uint, bool and string field of the struct v
// points to a distinct non-zero value, so that a conversion that drops a
// field shows.
func fillNonZero(v any) {
	s := reflect.ValueOf(v).Elem()
	for i := 0; i < s.NumField(); i++ {
		f := s.Field(i)
		switch f.Kind() {
		case reflect.Int, reflect.Int32, reflect.Int64:
			f.SetInt(int64(i + 1))
		case reflect.Uint, reflect.Uint32, reflect.Uint64:
			f.SetUint(uint64(i + 1))
		case reflect.Bool:
			f.SetBool(true)
		case reflect.String:
			f.SetString(s.Type().Field(i).Name)
		}
	}
}

// Every field of a decision, a receipt and a charge crosses the internal
// RPC, except those that mean something on the deciding node only. The
// client once dropped MonthUnits and MonthUsed, which read 0 through it.
func TestConversionsKeepEveryField(t *testing.T) {
	var d shard.Decision
	fillNonZero(&d)
	d.Reason = shard.QuotaExceeded
	got := decisionFromPB(decisionToPB(&d))
	d.Seq, d.Shortfall = 0, 0 // the owner's own: its log, its reservations
	if got != d {
		t.Errorf("decision through the RPC:\n got %+v\nwant %+v", got, d)
	}

	var r shard.Receipt
	fillNonZero(&r)
	r.Allocs = []shard.Alloc{{Grant: "g1", Units: 3}, {Grant: "g2", Units: 4}}
	if got := receiptFromPB(receiptToPB(&r)); !reflect.DeepEqual(*got, r) {
		t.Errorf("receipt through the RPC:\n got %+v\nwant %+v", *got, r)
	}

	var c ChargeRequest
	fillNonZero(&c)
	in := chargeFromPB(chargeToPB(&c))
	want := shard.Charge{EventID: c.EventID, ClientID: c.ClientID, Key: c.Key, Route: c.Route, Units: c.Units, Target: c.Target}
	if in.Account != c.Account || in.Charge != want {
		t.Errorf("charge through the RPC: %+v, want account %s and %+v", in, c.Account, want)
	}
	if back := chargeRequestFromPB(chargeToPB(&c)); back != c {
		t.Errorf("a routed charge through the RPC: %+v, want %+v", back, c)
	}
	if n := reflect.TypeOf(c).NumField(); n != 7 {
		t.Errorf("ChargeRequest has %d fields: check that chargeToPB and this test carry the new one", n)
	}
}
