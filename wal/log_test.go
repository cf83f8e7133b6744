package wal

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/quotaring/quotaring/internal/gatefs"
)

func TestOpenValidatesOptions(t *testing.T) {
	if _, err := Open(Options{Dir: "data", FS: vfs.NewMem()}); err == nil {
		t.Fatal("Open without NodeID succeeded")
	}
	if _, err := Open(Options{NodeID: "n", FS: vfs.NewMem()}); err == nil {
		t.Fatal("Open without Dir succeeded")
	}
}

// TestSequenceOrder checks that concurrent Appends get 1, 2, 3, ... in call
// order: each goroutine sees its own seqs increase, together they are
// exactly 1..N, and Scan returns each payload under its seq.
func TestSequenceOrder(t *testing.T) {
	l := mustOpen(t, testOpts(vfs.NewMem()))
	const workers, each = 8, 100
	var mu sync.Mutex
	bySeq := map[uint64]string{}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			var prev uint64
			for i := range each {
				p := []byte{byte(w), byte(i)}
				seq, err := l.Append(p)
				if err != nil || seq <= prev {
					t.Errorf("Append = %d, %v after %d", seq, err, prev)
					return
				}
				prev = seq
				mu.Lock()
				bySeq[seq] = string(p)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if err := l.WaitDurable(context.Background(), workers*each); err != nil {
		t.Fatal(err)
	}
	got := readAll(t, l)
	requireContiguous(t, got, 0, workers*each)
	for seq, p := range bySeq {
		if got[seq] != p {
			t.Fatalf("record %d = %q, appended %q", seq, got[seq], p)
		}
	}
	if l.LastSeq() != workers*each || l.DurableSeq() != workers*each {
		t.Fatalf("LastSeq %d DurableSeq %d, want %d", l.LastSeq(), l.DurableSeq(), workers*each)
	}
}

// TestDurableOnlyAfterCommitReturns holds the WAL fsync of a commit and
// checks that, while Pebble's Commit has not returned, the record is visible
// to a raw Pebble read but DurableSeq, WaitDurable and Scan do not pass it.
func TestDurableOnlyAfterCommitReturns(t *testing.T) {
	fs := gatefs.New(vfs.NewMem())
	var commits []int
	opts := testOpts(fs)
	opts.OnCommit = func(records, _ int, _ time.Duration) { commits = append(commits, records) }
	l := mustOpen(t, opts)
	appendDurable(t, l, payloadFor(1))

	fs.Arm()
	seq2, err := l.Append(payloadFor(2))
	if err != nil {
		t.Fatal(err)
	}
	<-fs.Entered // the commit of seq 2 is inside fsync
	seq3, err := l.Append(payloadFor(3))
	if err != nil {
		t.Fatal(err)
	}
	// Pebble publishes a batch to readers before its fsync completes (the
	// fsync may begin a moment before the publication, hence the wait).
	waitUntil(t, "Pebble to show the unsynced write", func() bool {
		_, closer, err := l.db.Get(recordKey(seq2))
		if err == nil {
			closer.Close()
		}
		return err == nil
	})
	if d := l.DurableSeq(); d != 1 {
		t.Fatalf("DurableSeq = %d during the fsync of seq 2, want 1", d)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	errIs(t, l.WaitDurable(ctx, seq2), context.Canceled)
	if got := readAll(t, l); len(got) != 1 {
		t.Fatalf("Scan during the fsync returned %d records, want 1", len(got))
	}

	fs.Release()
	if err := l.WaitDurable(context.Background(), seq3); err != nil {
		t.Fatal(err)
	}
	if l.DurableSeq() != 3 {
		t.Fatalf("DurableSeq = %d, want 3", l.DurableSeq())
	}
	// seq 3 was appended during the commit of seq 2, so it went in a commit
	// of its own; OnCommit saw 1, 1, 1 (read after WaitDurable: the hook runs
	// after the wake-up, so wait for Close to be sure it ran).
	_ = l.Close()
	if want := []int{1, 1, 1}; !equalInts(commits, want) {
		t.Fatalf("OnCommit records = %v, want %v", commits, want)
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestWaitDurable(t *testing.T) {
	l := mustOpen(t, testOpts(vfs.NewMem()))
	if err := l.WaitDurable(context.Background(), 0); err != nil {
		t.Fatalf("WaitDurable(0) = %v", err)
	}
	seq := appendDurable(t, l, []byte("a"))

	ctx, cancel := context.WithCancel(context.Background())
	// seq+1 is never appended; cancel lands before or after the waiter
	// blocks, and either way it must return.
	go cancel()
	err := l.WaitDurable(ctx, seq+1)
	errIs(t, err, context.Canceled)
	if !strings.Contains(err.Error(), "seq 2") {
		t.Fatalf("error %q does not name the seq", err)
	}

	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.WaitDurable(context.Background(), seq); err != nil {
		t.Fatalf("WaitDurable of a durable record after Close = %v", err)
	}
	errIs(t, l.WaitDurable(context.Background(), seq+1), ErrClosed)
}

// TestCloseDrainsWaiters queues records behind a held fsync, closes, and
// checks that every waiter gets nil once Close committed the queue.
func TestCloseDrainsWaiters(t *testing.T) {
	fs := gatefs.New(vfs.NewMem())
	l := mustOpen(t, testOpts(fs))
	fs.Arm()
	if _, err := l.Append([]byte("first")); err != nil {
		t.Fatal(err)
	}
	<-fs.Entered
	const n = 10
	errs := make(chan error, n)
	for range n - 1 {
		seq, err := l.Append([]byte("queued"))
		if err != nil {
			t.Fatal(err)
		}
		go func() { errs <- l.WaitDurable(context.Background(), seq) }()
	}
	go func() { errs <- l.WaitDurable(context.Background(), n+1) }() // never appended
	closed := make(chan error)
	go func() { closed <- l.Close() }()
	waitUntil(t, "Close to begin", l.isClosing)
	if _, err := l.Append([]byte("late")); !errors.Is(err, ErrClosed) {
		t.Fatalf("Append during Close = %v, want ErrClosed", err)
	}
	fs.Release()
	if err := <-closed; err != nil {
		t.Fatalf("Close = %v", err)
	}
	var nils, closedErrs int
	for range n {
		switch err := <-errs; {
		case err == nil:
			nils++
		case errors.Is(err, ErrClosed):
			closedErrs++
		default:
			t.Fatalf("waiter got %v", err)
		}
	}
	if nils != n-1 || closedErrs != 1 || l.DurableSeq() != n {
		t.Fatalf("nil answers %d, ErrClosed %d, DurableSeq %d; want %d, 1, %d",
			nils, closedErrs, l.DurableSeq(), n-1, n)
	}
	if err := l.Close(); err != nil {
		t.Fatalf("second Close = %v", err)
	}
	if err := l.Scan(0, 10, nil); !errors.Is(err, ErrClosed) {
		t.Fatalf("Scan after Close = %v", err)
	}
	// Settle read Pebble before it registered: after Close it panicked
	// ("pebble: closed") instead of answering ErrClosed.
	if err := l.Settle(l.DurableSeq(), nil); !errors.Is(err, ErrClosed) {
		t.Fatalf("Settle after Close = %v", err)
	}
}

// TestBackPressure checks that Append blocks while MaxPendingBytes wait for
// the committer, and goes on once the commit returns.
func TestBackPressure(t *testing.T) {
	fs := gatefs.New(vfs.NewMem())
	opts := testOpts(fs)
	opts.MaxPendingBytes = 100
	l := mustOpen(t, opts)
	fs.Arm()
	big := bytes.Repeat([]byte("x"), 100)
	if _, err := l.Append(big); err != nil {
		t.Fatal(err)
	}
	<-fs.Entered
	done := make(chan uint64)
	go func() {
		seq, err := l.Append([]byte("blocked"))
		if err != nil {
			t.Error(err)
		}
		done <- seq
	}()
	waitUntil(t, "Append to block", func() bool { return l.Stats().AppendWaits > 0 })
	select {
	case seq := <-done:
		t.Fatalf("Append returned %d while the pending bytes were over the bound", seq)
	default:
	}
	fs.Release()
	if seq := <-done; seq != 2 {
		t.Fatalf("blocked Append got seq %d, want 2", seq)
	}
}

// TestMaxBatchBytes checks that the committer splits a long queue into
// commits of at most MaxBatchBytes, and that Append refuses a larger payload.
func TestMaxBatchBytes(t *testing.T) {
	fs := gatefs.New(vfs.NewMem())
	opts := testOpts(fs)
	opts.MaxBatchBytes = 1000
	var mu sync.Mutex
	var sizes []int
	opts.OnCommit = func(_, b int, _ time.Duration) {
		mu.Lock()
		sizes = append(sizes, b)
		mu.Unlock()
	}
	l := mustOpen(t, opts)
	if _, err := l.Append(make([]byte, 1001)); err == nil {
		t.Fatal("Append of a payload over MaxBatchBytes succeeded")
	}
	fs.Arm()
	if _, err := l.Append([]byte("hold")); err != nil {
		t.Fatal(err)
	}
	<-fs.Entered
	var last uint64
	for range 100 {
		last, _ = l.Append(make([]byte, 86)) // 100 bytes with key and frame
	}
	fs.Release()
	if err := l.WaitDurable(context.Background(), last); err != nil {
		t.Fatal(err)
	}
	_ = l.Close() // OnCommit of the last commit has run
	if len(sizes) != 11 {
		t.Fatalf("commits = %d (%v), want 1 + 10", len(sizes), sizes)
	}
	for _, s := range sizes {
		if s > opts.MaxBatchBytes {
			t.Fatalf("a commit wrote %d bytes > MaxBatchBytes %d", s, opts.MaxBatchBytes)
		}
	}
}

// TestGroupCommit runs 64 goroutines that each append and wait, as request
// handlers do, and checks that commits are far fewer than appends.
func TestGroupCommit(t *testing.T) {
	opts := Options{Dir: t.TempDir(), NodeID: "node-1"} // a real disk: real fsyncs
	var mu sync.Mutex
	var recs []int
	opts.OnCommit = func(r, _ int, _ time.Duration) {
		mu.Lock()
		recs = append(recs, r)
		mu.Unlock()
	}
	l := mustOpen(t, opts)
	const workers, each = 64, 50
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for range each {
				seq, err := l.Append(make([]byte, 100))
				if err == nil {
					err = l.WaitDurable(context.Background(), seq)
				}
				if err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	st := l.Stats()
	appends := uint64(workers * each)
	perK := float64(st.Fsyncs) * 1000 / float64(appends)
	t.Logf("%d appends, %d commits, %d fsyncs: %.1f fsyncs per 1000 appends", appends, st.Commits, st.Fsyncs, perK)
	if st.Commits >= appends || perK > 250 {
		t.Fatalf("group commit is not grouping: %.1f fsyncs per 1000 appends", perK)
	}
	if st.DurableSeq != appends {
		t.Fatalf("DurableSeq = %d, want %d", st.DurableSeq, appends)
	}
}

// TestGroupCommitGathersWhileSyncing holds one fsync while 64 goroutines
// append, and checks that the next commit carries all 64 records.
func TestGroupCommitGathersWhileSyncing(t *testing.T) {
	fs := gatefs.New(vfs.NewMem())
	opts := testOpts(fs)
	var mu sync.Mutex
	var recs []int
	opts.OnCommit = func(r, _ int, _ time.Duration) {
		mu.Lock()
		recs = append(recs, r)
		mu.Unlock()
	}
	l := mustOpen(t, opts)
	fs.Arm()
	if _, err := l.Append([]byte("hold")); err != nil {
		t.Fatal(err)
	}
	<-fs.Entered
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			seq, err := l.Append([]byte("r"))
			if err == nil {
				err = l.WaitDurable(context.Background(), seq)
			}
			if err != nil {
				t.Error(err)
			}
		})
	}
	waitUntil(t, "64 appends", func() bool { return l.LastSeq() == 65 })
	fs.Release()
	wg.Wait()
	_ = l.Close()
	if want := []int{1, 64}; !equalInts(recs, want) {
		t.Fatalf("records per commit = %v, want %v", recs, want)
	}
	if st := l.Stats(); st.Commits != 2 || st.Fsyncs != 2 {
		t.Fatalf("Commits %d Fsyncs %d, want 2 and 2", st.Commits, st.Fsyncs)
	}
}

func TestIncarnationAndNodeID(t *testing.T) {
	fs := vfs.NewMem()
	l, err := Open(testOpts(fs))
	if err != nil {
		t.Fatal(err)
	}
	inc := l.Incarnation()
	if len(inc) != 32 || strings.Trim(inc, "0123456789abcdef") != "" {
		t.Fatalf("Incarnation = %q, want 32 hex digits", inc)
	}
	if l.NodeID() != "node-1" || l.Dir() != "data" {
		t.Fatalf("NodeID %q Dir %q", l.NodeID(), l.Dir())
	}
	_ = l.Close()

	l = mustOpen(t, testOpts(fs))
	if l.Incarnation() != inc {
		t.Fatalf("incarnation changed across reopen: %s -> %s", inc, l.Incarnation())
	}
	_ = l.Close()

	other := mustOpen(t, testOpts(vfs.NewMem()))
	if other.Incarnation() == inc {
		t.Fatal("a new dir got the same incarnation")
	}

	opts := testOpts(fs)
	opts.NodeID = "node-2"
	_, err = Open(opts)
	errIs(t, err, ErrNodeMismatch)
	for _, want := range []string{"node-1", "node-2", "data"} {
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("mismatch error %q does not name %q", err, want)
		}
	}
}

func TestMeta(t *testing.T) {
	fs := vfs.NewMem()
	l := mustOpen(t, testOpts(fs))
	if _, ok, err := l.GetMeta("snapshot"); ok || err != nil {
		t.Fatalf("GetMeta of a missing name = %v, %v", ok, err)
	}
	if err := l.PutMeta("snapshot", []byte("v1")); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"", metaSettledSeq, "wal.anything"} {
		if err := l.PutMeta(name, []byte("x")); err == nil {
			t.Fatalf("PutMeta(%q) succeeded", name)
		}
	}
	_ = l.Close()
	l = mustOpen(t, testOpts(fs))
	v, ok, err := l.GetMeta("snapshot")
	if string(v) != "v1" || !ok || err != nil {
		t.Fatalf("GetMeta after reopen = %q, %v, %v", v, ok, err)
	}
	if v, _, _ := l.GetMeta(metaNodeID); string(v) != "node-1" {
		t.Fatalf("GetMeta(%s) = %q", metaNodeID, v)
	}
}

func TestFatalfNeverReturns(t *testing.T) {
	var code int
	p := pebbleLogger{log: testOpts(nil).withDefaultsMust(t).Logger, exit: func(c int) { code = c }}
	defer func() {
		r := recover()
		if _, ok := r.(fatalError); !ok || code != 1 {
			t.Fatalf("recovered %v with exit code %d, want a fatalError after exit(1)", r, code)
		}
	}()
	p.Fatalf("fsync failed: %s", "EIO")
	t.Fatal("Fatalf returned")
}

func (o Options) withDefaultsMust(t *testing.T) Options {
	o.FS = vfs.NewMem()
	o, err := o.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	return o
}

func TestAnyNodeOpensAStoppedNodesDir(t *testing.T) {
	dir := t.TempDir()
	l, err := Open(Options{Dir: dir, NodeID: "node-7"})
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	r, err := Open(Options{Dir: dir, AnyNode: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.NodeID() != "node-7" {
		t.Fatalf("NodeID %q, want the stored node-7", r.NodeID())
	}
	if _, err := Open(Options{Dir: t.TempDir() + "/missing", AnyNode: true}); err == nil {
		t.Fatal("AnyNode opened a dir that is not a data dir")
	}
}
