package node

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
)

// A node that finds a later process started as its node id (two replicas
// given one --node-id that passed the start check together) stops taking
// charges, settles what it holds and hands nothing back: the reservations
// under the id are the other process's now.
func TestFencedByALaterProcess(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acme": 1000})
	nd := startNodes(t, dsn, 1)[0]
	ctx := context.Background()
	if res, err := nd.Router().Charge(ctx, router.ChargeRequest{Account: "acme", Route: "GET /x", Units: 3}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v, %v", res, err)
	}
	l, err := flush.Open(ctx, dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	waitFor(t, 10*time.Second, "two checks of the latest start", func() bool { return nd.fenceChecks.Load() >= 2 })
	select {
	case <-nd.Fenced():
		t.Fatal("fenced by its own start")
	default:
	}
	held := func() int64 { return unitsReserved(t, l) }
	if held() == 0 {
		t.Fatal("the node holds no reservation for acme")
	}

	// Another process registers as n1 on a data dir of its own.
	if _, err := l.RegisterNode(ctx, nd.ID(), "other-inc"); err != nil {
		t.Fatal(err)
	}
	if err := l.RecordStart(ctx, nd.ID(), "other-inc", flush.NodeStart{Build: "v-other", Process: "other"}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-nd.Fenced():
	case <-time.After(10 * time.Second):
		t.Fatal("the node did not notice the later process")
	}
	if _, err := nd.Router().Charge(ctx, router.ChargeRequest{Account: "acme", Route: "GET /x", Units: 1}); err == nil {
		t.Fatal("a fenced node still charges")
	}
	before := held()
	if err := nd.StopFenced(ctx); !errors.Is(err, ErrFenced) {
		t.Fatalf("StopFenced: %v, want ErrFenced", err)
	}
	if got := held(); got != before {
		t.Fatalf("the fenced node handed back reservations: %d units held before its stop, %d after", before, got)
	}
	events, err := l.Events(ctx, "acme")
	if err != nil || len(events) != 1 || events[0].Units != 3 {
		t.Fatalf("acme's events after the fenced stop: %+v, %v; want the one charge of 3 settled", events, err)
	}
}

// unitsReserved is every unit l holds reserved, for any node.
func unitsReserved(t *testing.T, l flush.Ledger) int64 {
	t.Helper()
	rs, err := l.Reservations(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var units int64
	for _, r := range rs {
		units += r.Units
	}
	return units
}
