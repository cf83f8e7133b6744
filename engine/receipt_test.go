package engine

import (
	"context"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// Through the real log: K used in June and in July (generation 0 both
// times), June's use refunded by its receipt in July; a restart before a
// checkpoint covers the records (a crash within a settle interval, any
// restart while the ledger is down) replayed that refund onto July's use,
// and the client's retry of July's K was billed again as generation 1.
func TestARestartReplaysAReceiptRefundOntoItsOwnCharge(t *testing.T) {
	ctx := context.Background()
	e, dir, clock := openRestartable(t, map[string]int64{"acme": 1000})
	june, err := e.Charge(ctx, "acme", shard.Charge{EventID: "K", ClientID: true, Route: "r", Units: 10})
	if err != nil || june.Reason != shard.OK {
		t.Fatal(june.Reason, err)
	}
	clock.Advance(35 * 24 * time.Hour) // 15 July
	if res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "K", ClientID: true, Route: "r", Units: 7}); err != nil || res.Reason != shard.OK {
		t.Fatal(res.Reason, err)
	}
	if d, err := e.Refund(ctx, "acme", "K", june.Receipt); err != nil || d.Reason != shard.Refunded || d.Units != 10 {
		t.Fatal(d, err)
	}
	clock.Advance(time.Hour)
	if res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "K", ClientID: true, Route: "r", Units: 7}); err != nil || res.Reason != shard.Replayed {
		t.Fatalf("before restart: %v %v", res.Reason, err)
	}
	e.Close()
	e.Log().Close()
	e2 := openEngine(t, dir, clock, nil)
	res, err := e2.Charge(ctx, "acme", shard.Charge{EventID: "K", ClientID: true, Route: "r", Units: 7})
	if err != nil || res.Reason != shard.Replayed {
		t.Errorf("the same retry after a restart: %v (err %v, receipt gen %d), want replayed", res.Reason, err, res.Receipt.Gen)
	}
}
