package flush

// BenchmarkSettle measures Settle on the package's throwaway Postgres
// (pgtest: fsync off, synchronous_commit on), with the event log on and off,
// for batches of 1k, 10k and 100k charges over 1,000 accounts. Run it with
//
//	QUOTARING_REQUIRE_PG=1 go test -run '^$' -bench BenchmarkSettle -benchtime 5x ./flush
//
// It reports records/s (charges settled per second of Settle) and
// roundtrips/op (SettleResult.RoundTrips: statements per settle, which must
// not grow with the batch). The product's targets: >= 100,000 records/s with
// the event log on, >= 1,000,000 with aggregates only.
//
// BenchmarkSettleDuplicate is the rare path: a 100k batch with one charge
// the log already holds, which sends the batch through staging.
// BenchmarkSettleSQLite is the embedded ledger, for comparison (-bench
// 'BenchmarkSettle(Duplicate|SQLite)').

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/pgtest"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

const benchAccounts = 1000

var benchRoutes = [...]string{"GET /v1/items", "GET /v1/items/{id}", "POST /v1/items", "POST /v1/exports"}

func BenchmarkSettle(b *testing.B) {
	for _, events := range []bool{true, false} {
		for _, size := range []int{1_000, 10_000, 100_000} {
			b.Run(fmt.Sprintf("events=%v/charges=%d", events, size), func(b *testing.B) {
				benchSettle(b, events, size)
			})
		}
	}
}

func BenchmarkSettleDuplicate(b *testing.B) {
	const size = 100_000
	benchSettleWith(b, pgBench(b), func(mark uint64, round int) *Batch {
		batch := benchBatch(mark, round, size, true)
		batch.Charges[size/2].EventID = "warm-e0" // settled by the warm-up round
		return batch
	}, size)
}

// BenchmarkSettleMonthEdge settles batches of 100,000 charges charged on
// the last day of June, half of them with client ids, after a warm-up round
// put 100,000 events into July's partition: every client-id charge is
// looked up in the neighbouring month (pgCrossMonthSQL), none found.
// Compare with BenchmarkSettle/events=true/charges=100000 in the same run.
func BenchmarkSettleMonthEdge(b *testing.B) {
	const size = 100_000
	june30 := time.Date(2026, 6, 30, 12, 0, 0, 0, time.UTC).UnixNano()
	july1 := time.Date(2026, 7, 1, 6, 0, 0, 0, time.UTC).UnixNano()
	benchSettleWith(b, pgBench(b), func(mark uint64, round int) *Batch {
		batch := benchBatch(mark, round, size, true)
		wall, per := june30, shard.Period(2026*12+5)
		if round < 0 {
			wall, per = july1, per+1
		}
		for i := range batch.Charges {
			c := &batch.Charges[i]
			c.Wall, c.Period = wall+int64(i)*int64(time.Millisecond), per
			c.Allocs = []shard.Alloc{{Grant: shard.MonthlyGrantID(per), Units: c.Units}}
		}
		return batch
	}, size)
}

func BenchmarkSettleSQLite(b *testing.B) {
	for _, events := range []bool{true, false} {
		for _, size := range []int{1_000, 10_000, 100_000} {
			b.Run(fmt.Sprintf("events=%v/charges=%d", events, size), func(b *testing.B) {
				l, err := OpenSQLite(context.Background(), b.TempDir()+"/ledger.db", SQLiteOptions{})
				if err != nil {
					b.Fatal(err)
				}
				benchSettleWith(b, l, func(mark uint64, round int) *Batch { return benchBatch(mark, round, size, events) }, size)
			})
		}
	}
}

func pgBench(b *testing.B) Ledger {
	l, err := OpenPostgres(context.Background(), pgtest.NewDB(b), PGOptions{})
	if err != nil {
		b.Fatal(err)
	}
	return l
}

func benchSettle(b *testing.B, events bool, size int) {
	benchSettleWith(b, pgBench(b), func(mark uint64, round int) *Batch { return benchBatch(mark, round, size, events) }, size)
}

// benchSettleWith settles b.N batches made by batchAt after a warm-up
// round, timing Settle alone.
func benchSettleWith(b *testing.B, l Ledger, batchAt func(mark uint64, round int) *Batch, size int) {
	ctx := context.Background()
	defer l.Close()
	if err := l.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	if err := l.UpsertPlan(ctx, snapshot.Plan{ID: "bench", MonthlyQuota: 1 << 40, Hard: true}); err != nil {
		b.Fatal(err)
	}
	for i := range benchAccounts {
		if err := l.UpsertAccount(ctx, benchAccount(i), "bench"); err != nil {
			b.Fatal(err)
		}
	}
	mark, err := l.RegisterNode(ctx, "bench-node", "inc-1")
	if err != nil {
		b.Fatal(err)
	}
	settle := func(round int) SettleResult {
		batch := batchAt(mark, round)
		b.StartTimer()
		res, err := l.Settle(ctx, batch)
		b.StopTimer()
		if err != nil || !res.Applied {
			b.Fatalf("settle: %+v, %v", res, err)
		}
		mark = batch.Next
		return res
	}
	b.StopTimer()
	settle(-1) // event partition, monthly grants and prepared statements in place, as in a running node
	b.ResetTimer()
	b.StopTimer()
	var trips int
	for i := range b.N {
		trips = settle(i).RoundTrips
	}
	b.ReportMetric(float64(size)*float64(b.N)/b.Elapsed().Seconds(), "records/s")
	b.ReportMetric(float64(trips), "roundtrips/op")
}

func benchAccount(i int) string { return fmt.Sprintf("acct-%04d", i) }

// benchRound names a round in event ids: the warm-up round is "warm".
func benchRound(round int) string {
	if round < 0 {
		return "warm"
	}
	return fmt.Sprintf("r%d", round)
}

// benchBatch makes size charges after mark, spread over the accounts, four
// routes and one day, paid from the June monthly grant out of the node's
// reservation, with event ids unique across rounds.
func benchBatch(mark uint64, round, size int, events bool) *Batch {
	const grant = "m:2026-06"
	wall := time.Date(2026, 6, 15, 0, 0, 0, 0, time.UTC).UnixNano()
	b := &Batch{Node: "bench-node", Incarnation: "inc-1", Prev: mark, Next: mark + uint64(size), Events: events,
		Charges: make([]Charge, size)}
	for i := range size {
		units := int64(1 + i%3)
		a := i % benchAccounts
		b.Charges[i] = Charge{
			Seq: mark + uint64(i) + 1, Account: benchAccount(a), EventID: fmt.Sprintf("%s-e%d", benchRound(round), i), ClientID: i%2 == 0,
			Key: fmt.Sprintf("key-%04d", a), Route: benchRoutes[i%len(benchRoutes)], Units: units,
			Wall: wall + int64(i)*int64(time.Millisecond), Period: shard.Period(2026*12 + 5), Reserved: true,
			Allocs: []shard.Alloc{{Grant: grant, Units: units}},
		}
	}
	return b
}

// BenchmarkReserve measures Reserve on Postgres: 8 callers of one node
// (the engine's top-ups run in parallel) reserve one unit at a time over
// 1,000 accounts, with the node's reservation lock (ReleaseNode waits on
// it) and without, side by side:
//
//	QUOTARING_REQUIRE_PG=1 go test -run '^$' -bench BenchmarkReserve -benchtime 3s ./flush
func BenchmarkReserve(b *testing.B) {
	for _, lock := range []bool{true, false} {
		b.Run(fmt.Sprintf("lock=%v", lock), func(b *testing.B) {
			ctx := context.Background()
			l := pgBench(b).(*Postgres)
			defer l.Close()
			l.noReserveLock = !lock
			if err := l.Migrate(ctx); err != nil {
				b.Fatal(err)
			}
			if err := l.UpsertPlan(ctx, snapshot.Plan{ID: "bench", MonthlyQuota: 1 << 40, Hard: true}); err != nil {
				b.Fatal(err)
			}
			for i := range benchAccounts {
				if err := l.UpsertAccount(ctx, fmt.Sprintf("acct-%d", i), "bench"); err != nil {
					b.Fatal(err)
				}
			}
			wall := time.Date(2026, 6, 15, 12, 0, 0, 0, time.UTC)
			var next atomic.Int64
			b.SetParallelism(4) // 8 callers on 2 cores
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					acct := fmt.Sprintf("acct-%d", next.Add(1)%benchAccounts)
					if _, err := l.Reserve(ctx, "node-a", ReserveRequest{Account: acct, Wall: wall, Need: 1}); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
