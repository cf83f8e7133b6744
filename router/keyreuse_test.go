package router_test

import (
	"context"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/shard"
)

// An Idempotency-Key sent again ten days after its first request is new
// work, through the proxy of a three-node cluster: served and charged
// again, and billed twice in the ledger (once per use), while a retry
// within the day is served and billed once. Before, the ledger took the
// second use for a retry and billed the month one write.
func TestProxyKeyUsedAgainAfterADayIsBilledAgain(t *testing.T) {
	up := newUpstream(t)
	acme := account{id: "acme", key: keyOf("acme"), plan: monthly("m60", 60)}
	june2 := time.Date(2026, 6, 2, 12, 0, 0, 0, time.UTC)
	c := startCluster(t, []account{acme}, clusterOptions{nodes: 3, clock: engine.NewManualClock(june2), upstream: up.URL})
	proxy := "http://" + c.notOwner(t, acme.id).HTTPAddr()
	write := func(what string, remaining string) {
		t.Helper()
		expect(t, what, do(t, proxy, "POST", "/v1/tasks", acme.key, nil, "Idempotency-Key: order-7"), 200, remaining)
	}
	write("the first write", "58")
	c.clock.Advance(time.Minute)
	write("its retry a minute later (billed once)", "58")
	c.clock.Advance(10 * 24 * time.Hour)
	write("the key used again ten days later", "56")
	if n := up.count("POST /v1/tasks"); n != 3 {
		t.Fatalf("the upstream served %d writes, want 3", n)
	}

	l, err := flush.Open(context.Background(), c.dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	waitFor(t, 10*time.Second, "the ledger to bill both uses", func() bool {
		u, err := l.Usage(context.Background(), acme.id, shard.PeriodOf(june2.UnixNano()))
		return err == nil && u.Units == 4
	})
}
