package engine

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

func benchEngine(b *testing.B, noSync bool, accounts int) (*Engine, []string) {
	l, err := wal.Open(wal.Options{Dir: b.TempDir(), NodeID: "bench", NoSync: noSync})
	if err != nil {
		b.Fatal(err)
	}
	e, err := Open(Options{Log: l})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { e.Close(); l.Close() })
	ids := make([]string, accounts)
	s := &snapshot.Snapshot{Plans: []snapshot.Plan{{ID: "p", MonthlyQuota: 1 << 60, Hard: true}}}
	for i := range ids {
		ids[i] = fmt.Sprint("acct-", i)
		s.Accounts = append(s.Accounts, snapshot.Account{ID: ids[i], Plan: "p"})
	}
	if err := s.Build(); err != nil {
		b.Fatal(err)
	}
	if err := e.SetSnapshot(s, AllSettled); err != nil {
		b.Fatal(err)
	}
	return e, ids
}

// go test ./engine -run NONE -bench EngineCharge -benchmem
func BenchmarkEngineCharge(b *testing.B) {
	for _, mode := range []string{"nosync", "sync"} {
		for _, par := range []int{1, 64, 512} {
			b.Run(fmt.Sprintf("%s/callers=%d", mode, par), func(b *testing.B) {
				e, ids := benchEngine(b, mode == "nosync", 1000)
				stop := make(chan struct{})
				go func() {
					t := time.NewTicker(time.Second)
					defer t.Stop()
					for {
						select {
						case <-stop:
							return
						case <-t.C:
							e.Settle(context.Background(), e.Log().DurableSeq())
						}
					}
				}()
				defer close(stop)
				b.SetParallelism(par)
				b.ReportAllocs()
				b.ResetTimer()
				b.RunParallel(func(pb *testing.PB) {
					i := 0
					for pb.Next() {
						i++
						res, err := e.Charge(context.Background(), ids[i%len(ids)], shard.Charge{Route: "GET /v1/tasks", Units: 1})
						if err != nil || res.Reason != shard.OK {
							b.Fatal(res.Reason, err)
						}
					}
				})
			})
		}
	}
}

// go test ./engine -run NONE -bench SettleBusyKeyedAccounts -benchtime 20x
//
// Two accounts that each remember 100,000 Idempotency-Keys (the default
// bound) take 1,000 new keyed charges each (with a request digest, as the
// HTTP front sends), then settle: one op is that cycle. What a settle writes for them is what it measures: every key, or
// only those that changed.
func BenchmarkSettleBusyKeyedAccounts(b *testing.B) {
	e, ids := benchEngine(b, true, 2)
	ctx := context.Background()
	n := 0
	charge := func(k int) {
		for _, acct := range ids {
			for range k {
				n++
				res, err := e.Charge(ctx, acct, shard.Charge{EventID: fmt.Sprint("key-", n), ClientID: true, Route: "GET /v1/tasks", Units: 1, Target: uint64(n)})
				if err != nil || res.Reason != shard.OK {
					b.Fatal(res.Reason, err)
				}
			}
		}
	}
	charge(shard.DefaultParams().DedupMax)
	if err := e.Settle(ctx, e.Log().DurableSeq()); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		charge(1000)
		if err := e.Settle(ctx, e.Log().DurableSeq()); err != nil {
			b.Fatal(err)
		}
	}
}
