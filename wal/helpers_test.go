package wal

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/quotaring/quotaring/internal/gatefs"
)

// testOpts returns Options for a test log on fs under dir "data".
func testOpts(fs vfs.FS) Options {
	return Options{Dir: "data", NodeID: "node-1", FS: fs}
}

// mustOpen opens a log and closes it when the test ends.
func mustOpen(t testing.TB, opts Options) *Log {
	t.Helper()
	l, err := Open(opts)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { _ = l.Close() })
	if g, ok := opts.FS.(*gatefs.FS); ok {
		t.Cleanup(g.Release) // runs first: a failed test must not hang Close
	}
	return l
}

// appendDurable appends payload and waits until it is durable.
func appendDurable(t testing.TB, l *Log, payload []byte) uint64 {
	t.Helper()
	seq, err := l.Append(payload)
	if err != nil {
		t.Fatalf("Append: %v", err)
	}
	if err := l.WaitDurable(context.Background(), seq); err != nil {
		t.Fatalf("WaitDurable(%d): %v", seq, err)
	}
	return seq
}

// payloadFor returns the payload the tests write for seq.
func payloadFor(seq uint64) []byte { return fmt.Appendf(nil, "record-%d", seq) }

// readAll returns every durable unsettled record, by seq.
func readAll(t testing.TB, l *Log) map[uint64]string {
	t.Helper()
	got := map[uint64]string{}
	err := l.Scan(0, ^uint64(0), func(seq uint64, payload []byte) error {
		got[seq] = string(payload)
		return nil
	})
	if err != nil {
		t.Fatalf("Scan: %v", err)
	}
	return got
}

// requireContiguous fails unless the records are exactly from+1..to.
func requireContiguous(t testing.TB, recs map[uint64]string, from, to uint64) {
	t.Helper()
	if uint64(len(recs)) != to-from {
		t.Fatalf("have %d records, want %d (seq %d..%d)", len(recs), to-from, from+1, to)
	}
	for s := from + 1; s <= to; s++ {
		if _, ok := recs[s]; !ok {
			t.Fatalf("record %d missing (want %d..%d)", s, from+1, to)
		}
	}
}

// waitUntil spins, yielding the processor, until cond holds. It never
// sleeps: cond must become true through work other goroutines are doing.
func waitUntil(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		runtime.Gosched()
	}
}

// isClosing reports whether Close has begun.
func (l *Log) isClosing() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closing
}

// errIs fails unless errors.Is(err, target).
func errIs(t testing.TB, err, target error) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("err = %v, want one wrapping %v", err, target)
	}
}
