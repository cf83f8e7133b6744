package wal

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/quotaring/quotaring/internal/gatefs"
)

func TestSettle(t *testing.T) {
	fs := vfs.NewMem()
	l := mustOpen(t, testOpts(fs))
	for i := range 10 {
		appendDurable(t, l, payloadFor(uint64(i+1)))
	}
	cps := []Checkpoint{{Account: "acct-1", Seq: 3, Data: []byte("a1")}, {Account: "acct-2", Seq: 4, Data: []byte("a2")}}
	if err := l.Settle(4, cps); err != nil {
		t.Fatal(err)
	}
	requireContiguous(t, readAll(t, l), 4, 10)
	if st := l.Stats(); st.Records != 6 || st.SettledSeq != 4 {
		t.Fatalf("Stats after settle = %+v, want 6 records, settled 4", st)
	}
	for _, bad := range []uint64{3, 11} {
		if err := l.Settle(bad, nil); err == nil {
			t.Fatalf("Settle(%d) with settled 4, durable 10 succeeded", bad)
		}
	}
	// Settling to the mark again only writes checkpoints.
	if err := l.Settle(4, []Checkpoint{{Account: "acct-3", Seq: 4, Data: []byte("a3")}}); err != nil {
		t.Fatal(err)
	}
	if err := l.Settle(4, []Checkpoint{{Account: ""}}); err == nil {
		t.Fatal("Settle with an empty account succeeded")
	}
	_ = l.Close()

	l = mustOpen(t, testOpts(fs))
	if l.SettledSeq() != 4 || l.LastSeq() != 10 {
		t.Fatalf("after reopen settled %d last %d, want 4 and 10", l.SettledSeq(), l.LastSeq())
	}
	requireContiguous(t, readAll(t, l), 4, 10)
	want := map[string]Checkpoint{
		"acct-1": {Account: "acct-1", Seq: 3, Data: []byte("a1")},
		"acct-2": {Account: "acct-2", Seq: 4, Data: []byte("a2")},
		"acct-3": {Account: "acct-3", Seq: 4, Data: []byte("a3")},
	}
	requireCheckpoints(t, l, want)

	// Settle everything: no record is left, yet the sequence is not reused.
	if err := l.Settle(10, nil); err != nil {
		t.Fatal(err)
	}
	_ = l.Close()
	l = mustOpen(t, testOpts(fs))
	if got := readAll(t, l); len(got) != 0 {
		t.Fatalf("records left after settling all: %v", got)
	}
	if seq := appendDurable(t, l, []byte("next")); seq != 11 {
		t.Fatalf("first seq after settle and reopen = %d, want 11", seq)
	}
	if st := l.Stats(); st.Records != 1 || st.Bytes != recordKeyLen+frameHeaderLen+4 {
		t.Fatalf("Stats = %+v, want 1 record of %d bytes", st, recordKeyLen+frameHeaderLen+4)
	}
}

// A settle to the middle of a chunk (records 2..10 committed as one, since
// they queued behind the held fsync of record 1) keeps the chunk: the
// records above the settled mark are still to ship, and a scan from the
// mark returns exactly those, never the settled record it starts after.
func TestSettleInsideAChunkKeepsTheRest(t *testing.T) {
	fs := gatefs.New(vfs.NewMem())
	var mu sync.Mutex // guards commits, which the log's goroutine appends to
	var commits []int
	opts := testOpts(fs)
	opts.OnCommit = func(records, _ int, _ time.Duration) {
		mu.Lock()
		commits = append(commits, records)
		mu.Unlock()
	}
	l := mustOpen(t, opts)
	fs.Arm()
	if _, err := l.Append(payloadFor(1)); err != nil {
		t.Fatal(err)
	}
	<-fs.Entered // the commit of seq 1 is inside fsync: 2..10 queue as one chunk
	for i := uint64(2); i <= 10; i++ {
		if _, err := l.Append(payloadFor(i)); err != nil {
			t.Fatal(err)
		}
	}
	fs.Release()
	if err := l.WaitDurable(context.Background(), 10); err != nil {
		t.Fatal(err)
	}
	// OnCommit may run after the waiter is woken: wait for both commits.
	seen := func() string {
		mu.Lock()
		defer mu.Unlock()
		return fmt.Sprint(commits)
	}
	waitUntil(t, "commits of 1 and 9 records (the test needs records 2..10 in one chunk)", func() bool { return seen() == "[1 9]" })
	unsettled := func() map[uint64]string {
		t.Helper()
		got := map[uint64]string{}
		if err := l.Scan(l.SettledSeq(), l.DurableSeq(), func(seq uint64, p []byte) error {
			got[seq] = string(p)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return got
	}
	if err := l.Settle(5, nil); err != nil {
		t.Fatal(err)
	}
	requireContiguous(t, unsettled(), 5, 10)
	_ = l.Close()
	l = mustOpen(t, opts)
	if l.SettledSeq() != 5 {
		t.Fatalf("settled %d after reopen, want 5", l.SettledSeq())
	}
	got := unsettled()
	requireContiguous(t, got, 5, 10)
	for seq, p := range got {
		if p != string(payloadFor(seq)) {
			t.Fatalf("record %d = %q, want %q", seq, p, payloadFor(seq))
		}
	}
}

func requireCheckpoints(t *testing.T, l *Log, want map[string]Checkpoint) {
	t.Helper()
	got := map[string]Checkpoint{}
	var order []string
	err := l.Checkpoints(func(cp Checkpoint) error {
		got[cp.Account] = cp
		order = append(order, cp.Account)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("checkpoints = %v, want %v", got, want)
	}
	for a, w := range want {
		if g := got[a]; g.Seq != w.Seq || string(g.Data) != string(w.Data) {
			t.Fatalf("checkpoint %s = %+v, want %+v", a, g, w)
		}
	}
	for i := 1; i < len(order); i++ {
		if order[i-1] >= order[i] {
			t.Fatalf("checkpoints not in account order: %v", order)
		}
	}
}

func TestPutCheckpointsReplaces(t *testing.T) {
	l := mustOpen(t, testOpts(vfs.NewMem()))
	if err := l.PutCheckpoints([]Checkpoint{{Account: "a", Seq: 1, Data: []byte("old")}}); err != nil {
		t.Fatal(err)
	}
	if err := l.PutCheckpoints([]Checkpoint{{Account: "a", Seq: 2, Data: []byte("new")}, {Account: "b", Seq: 2}}); err != nil {
		t.Fatal(err)
	}
	requireCheckpoints(t, l, map[string]Checkpoint{"a": {Account: "a", Seq: 2, Data: []byte("new")}, "b": {Account: "b", Seq: 2, Data: nil}})
	stop := errors.New("stop")
	if err := l.Checkpoints(func(Checkpoint) error { return stop }); err != stop {
		t.Fatalf("Checkpoints did not return fn's error: %v", err)
	}
}

// A checkpoint's ids are stored apart, one key each: a checkpoint writes
// only those that changed (a nil value deletes one), ResetIDs drops the
// rest first, accounts whose names share a prefix keep their own, and ids
// written with another checkpoint than the one stored (a build that kept
// ids inline wrote it since) read as stale.
func TestCheckpointIDs(t *testing.T) {
	l := mustOpen(t, testOpts(vfs.NewMem()))
	put := func(cps ...Checkpoint) {
		t.Helper()
		if err := l.PutCheckpoints(cps); err != nil {
			t.Fatal(err)
		}
	}
	read := func() map[string]Checkpoint {
		t.Helper()
		got := map[string]Checkpoint{}
		if err := l.Checkpoints(func(cp Checkpoint) error { got[cp.Account] = cp; return nil }); err != nil {
			t.Fatal(err)
		}
		return got
	}
	ids := func(cp Checkpoint) string {
		var out []string
		for _, id := range cp.IDs {
			out = append(out, fmt.Sprintf("%c:%s=%s", id.Kind, id.ID, id.Value))
		}
		return strings.Join(out, " ")
	}
	put(Checkpoint{Account: "a", Seq: 3, IDs: []CheckpointID{{'d', "x", []byte("1")}, {'d', "y", []byte("2")}, {'r', "x", []byte("3")}}},
		Checkpoint{Account: "ab", Seq: 3, IDs: []CheckpointID{{'d', "x", []byte("9")}}})
	got := read()
	if ids(got["a"]) != "d:x=1 d:y=2 r:x=3" || ids(got["ab"]) != "d:x=9" || got["a"].IDsStale {
		t.Fatalf("after the first checkpoints: a %q, ab %q", ids(got["a"]), ids(got["ab"]))
	}
	put(Checkpoint{Account: "a", Seq: 5, IDs: []CheckpointID{{'d', "x", nil}, {'d', "z", []byte("4")}}})
	if got := read(); ids(got["a"]) != "d:y=2 d:z=4 r:x=3" || ids(got["ab"]) != "d:x=9" {
		t.Fatalf("after a delete and a put: a %q, ab %q", ids(got["a"]), ids(got["ab"]))
	}
	put(Checkpoint{Account: "a", Seq: 6, ResetIDs: true, IDs: []CheckpointID{{'d', "w", []byte("5")}}})
	if got := read(); ids(got["a"]) != "d:w=5" || ids(got["ab"]) != "d:x=9" {
		t.Fatalf("after a reset: a %q, ab %q", ids(got["a"]), ids(got["ab"]))
	}
	// IDsOnly drops the ids and leaves the checkpoint as it is.
	put(Checkpoint{Account: "ab", IDsOnly: true, ResetIDs: true})
	if got := read(); ids(got["ab"]) != "" || got["ab"].Seq != 3 || got["ab"].IDsStale || ids(got["a"]) != "d:w=5" {
		t.Fatalf("after dropping ab's ids alone: ab %+v, a %q", got["ab"], ids(got["a"]))
	}
	// A build that keeps ids inline writes the checkpoint and leaves the
	// ids and their mark as they were.
	if err := l.write(func(b *pebble.Batch) error {
		return b.Set(prefixKey(prefixCheckpoint, "a"), encodeFrame(append(encodeU64(7), "inline"...)), nil)
	}); err != nil {
		t.Fatal(err)
	}
	if got := read(); !got["a"].IDsStale || got["a"].IDs != nil || got["ab"].IDsStale {
		t.Fatalf("ids under another checkpoint's mark: %+v, want stale and none", got["a"])
	}
	if err := l.PutCheckpoints([]Checkpoint{{Account: "a", Seq: 8, IDs: []CheckpointID{{0, "m", []byte("x")}}}}); err == nil {
		t.Fatal("an id of kind 0 (the mark's) was stored")
	}
}

func TestByteMarks(t *testing.T) {
	var m byteMarks
	m.reset(0)
	m.add(10, 100) // records 1..10: 100 bytes
	m.add(20, 300) // records 11..20: 300 bytes
	if got := m.unsettled(); got != 400 {
		t.Fatalf("unsettled = %d, want 400", got)
	}
	m.settle(15) // half of the second commit: about 150 of its 300 bytes
	if got := m.unsettled(); got != 150 {
		t.Fatalf("unsettled after settle(15) = %d, want 150", got)
	}
	m.settle(20)
	if got := m.unsettled(); got != 0 {
		t.Fatalf("unsettled after settling all = %d", got)
	}
	for i := uint64(1); i <= 3*maxMarks; i++ {
		m.add(20+i, 10)
	}
	if len(m.marks) > maxMarks+1 || m.unsettled() != 30*maxMarks {
		t.Fatalf("after %d commits: %d marks, %d bytes", 3*maxMarks, len(m.marks), m.unsettled())
	}
	m.settle(20 + 3*maxMarks/2)
	if got := m.unsettled(); got < 14*maxMarks || got > 16*maxMarks {
		t.Fatalf("after thinning, half settled: %d bytes, want about %d", got, 15*maxMarks)
	}
}

func TestScanBounds(t *testing.T) {
	l := mustOpen(t, testOpts(vfs.NewMem()))
	for i := range 10 {
		appendDurable(t, l, payloadFor(uint64(i+1)))
	}
	scan := func(after, upto uint64) []uint64 {
		var seqs []uint64
		err := l.Scan(after, upto, func(seq uint64, p []byte) error {
			if string(p) != string(payloadFor(seq)) {
				t.Fatalf("record %d = %q", seq, p)
			}
			seqs = append(seqs, seq)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return seqs
	}
	for _, tc := range []struct {
		after, upto uint64
		n           int
		first       uint64
	}{{3, 6, 3, 4}, {0, 100, 10, 1}, {10, 20, 0, 0}, {5, 5, 0, 0}, {6, 2, 0, 0}, {0, 1, 1, 1}} {
		got := scan(tc.after, tc.upto)
		if len(got) != tc.n || tc.n > 0 && got[0] != tc.first {
			t.Fatalf("Scan(%d, %d) = %v, want %d records from %d", tc.after, tc.upto, got, tc.n, tc.first)
		}
	}
	stop := errors.New("stop")
	if err := l.Scan(0, 10, func(uint64, []byte) error { return stop }); err != stop {
		t.Fatalf("Scan did not return fn's error as is: %v", err)
	}
}
