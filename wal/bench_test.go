package wal

import (
	"context"
	"fmt"
	"sync"
	"testing"
)

// benchPayload is about the size of an encoded charge record.
const benchPayload = 128

// Run on a real disk (b.TempDir) with:
//
//	go test -run '^$' -bench 'BenchmarkAppend' -benchtime 20000x ./wal
//
// BenchmarkAppendSync measures Append + WaitDurable, as a request handler
// does, from par goroutines, and reports fsyncs/op: the fewer, the more group
// commit gathers.
func BenchmarkAppendSync(b *testing.B) {
	for _, par := range []int{1, 64, 512} {
		b.Run(fmt.Sprintf("par=%d", par), func(b *testing.B) {
			benchAppend(b, par, false)
		})
	}
}

// BenchmarkAppendNoSync is the same without fsync: the ceiling that
// Options.NoSync buys by giving up durability (see TestNoSyncLosesAcked).
func BenchmarkAppendNoSync(b *testing.B) {
	for _, par := range []int{1, 64} {
		b.Run(fmt.Sprintf("par=%d", par), func(b *testing.B) {
			benchAppend(b, par, true)
		})
	}
}

// benchAppend splits b.N appends over par goroutines, each appending and
// waiting for its record before the next.
func benchAppend(b *testing.B, par int, noSync bool) {
	l, err := Open(Options{Dir: b.TempDir(), NodeID: "bench", NoSync: noSync})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	payload := make([]byte, benchPayload)
	b.SetBytes(benchPayload)
	b.ReportAllocs()
	before := l.Stats()
	b.ResetTimer()
	var wg sync.WaitGroup
	for w := range par {
		n := b.N/par + boolInt(w < b.N%par)
		wg.Go(func() {
			for range n {
				seq, err := l.Append(payload)
				if err == nil {
					err = l.WaitDurable(context.Background(), seq)
				}
				if err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	after := l.Stats()
	b.ReportMetric(float64(after.Fsyncs-before.Fsyncs)/float64(b.N), "fsyncs/op")
	b.ReportMetric(float64(after.Commits-before.Commits)/float64(b.N), "commits/op")
}

func boolInt(v bool) int {
	if v {
		return 1
	}
	return 0
}
