package wal

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
)

// TestCrashCloneKeepsAcked appends from 8 goroutines, takes a crash clone of
// the file system at a seeded moment, reopens the clone, and requires every
// record whose WaitDurable returned nil before the clone. The clone keeps
// none, some or all of the unsynced data, which leaves Pebble's WAL with a
// torn tail in some runs.
func TestCrashCloneKeepsAcked(t *testing.T) {
	for _, tc := range []struct {
		seed     uint64
		unsynced int
	}{{1, 0}, {2, 50}, {3, 100}, {4, 30}, {5, 70}} {
		t.Run(fmt.Sprintf("seed=%d/unsynced=%d", tc.seed, tc.unsynced), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(tc.seed, 0))
			fs := vfs.NewCrashableMem()
			acked, crashed := appendUntilCrash(t, fs, 20+rng.IntN(500), vfs.CrashCloneCfg{
				UnsyncedDataPercent: tc.unsynced,
				RNG:                 rng,
			})
			l := mustOpen(t, testOpts(crashed))
			recs := readAll(t, l)
			for seq, p := range acked {
				if recs[seq] != p {
					t.Fatalf("acknowledged record %d = %q after the crash, want %q", seq, recs[seq], p)
				}
			}
			requireContiguous(t, recs, 0, l.LastSeq())
			if top := slices.Max(slices.Collect(maps.Keys(acked))); l.LastSeq() < top {
				t.Fatalf("LastSeq %d < acknowledged %d", l.LastSeq(), top)
			}
			if seq := appendDurable(t, l, []byte("after")); seq != l.LastSeq() || seq != uint64(len(recs))+1 {
				t.Fatalf("sequence resumed at %d, want %d", seq, len(recs)+1)
			}
			t.Logf("%d acknowledged before the crash, %d recovered", len(acked), len(recs))
		})
	}
}

// appendUntilCrash runs 8 appenders on fs until n records are acknowledged,
// then crash-clones fs. It returns the records acknowledged before the clone.
func appendUntilCrash(t *testing.T, fs *vfs.MemFS, n int, cfg vfs.CrashCloneCfg) (map[uint64]string, *vfs.MemFS) {
	l, err := Open(testOpts(fs))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	acked := map[uint64]string{}
	var stop atomic.Bool
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := 0; !stop.Load(); i++ {
				p := fmt.Sprintf("w%d-%d", w, i)
				seq, err := l.Append([]byte(p))
				if err == nil {
					err = l.WaitDurable(context.Background(), seq)
				}
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				acked[seq] = p
				mu.Unlock()
			}
		})
	}
	waitUntil(t, "acknowledgements", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(acked) >= n
	})
	mu.Lock()
	before := maps.Clone(acked) // each was durable before this point
	mu.Unlock()
	crashed := fs.CrashClone(cfg)
	stop.Store(true)
	wg.Wait()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return before, crashed
}

// TestNoSyncLosesAcked shows why NoSync is for benchmarks only: records
// whose WaitDurable returned nil are gone after a crash.
func TestNoSyncLosesAcked(t *testing.T) {
	fs := vfs.NewCrashableMem()
	opts := testOpts(fs)
	opts.NoSync = true
	l, err := Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	const n = 100
	for i := range n {
		appendDurable(t, l, payloadFor(uint64(i+1)))
	}
	crashed := fs.CrashClone(vfs.CrashCloneCfg{}) // only what was synced
	_ = l.Close()
	l = mustOpen(t, testOpts(crashed))
	kept := len(readAll(t, l))
	t.Logf("NoSync: %d of %d acknowledged records survived the crash", kept, n)
	if kept == n {
		t.Fatal("NoSync kept every acknowledged record: the test no longer shows the loss")
	}
}

// TestTornTailRecovers crashes, then cuts a few bytes off the newest Pebble
// WAL file, tearing the final record. Open must succeed with every earlier
// record, and the torn record's seq is assigned again (it was never
// durable, so never acknowledged).
func TestTornTailRecovers(t *testing.T) {
	fs := vfs.NewCrashableMem()
	l, err := Open(testOpts(fs))
	if err != nil {
		t.Fatal(err)
	}
	const n = 20
	for i := range n {
		appendDurable(t, l, payloadFor(uint64(i+1))) // one commit each
	}
	crashed := fs.CrashClone(vfs.CrashCloneCfg{})
	_ = l.Close()
	name := newestWAL(t, crashed, "data")
	truncateMem(t, crashed, name, 3)

	l = mustOpen(t, testOpts(crashed))
	recs := readAll(t, l)
	requireContiguous(t, recs, 0, n-1)
	if seq := appendDurable(t, l, []byte("again")); seq != n {
		t.Fatalf("next seq = %d, want %d", seq, n)
	}
}

// newestWAL returns the path of the Pebble WAL file with the highest number.
func newestWAL(t *testing.T, fs vfs.FS, dir string) string {
	t.Helper()
	names, err := fs.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	var logs []string
	for _, n := range names {
		if strings.HasSuffix(n, ".log") {
			logs = append(logs, n)
		}
	}
	if len(logs) == 0 {
		t.Fatalf("no WAL file in %s: %v", dir, names)
	}
	slices.Sort(logs) // zero-padded numbers sort as numbers
	return fs.PathJoin(dir, logs[len(logs)-1])
}

// truncateMem cuts cut bytes off the end of a file on a MemFS.
func truncateMem(t *testing.T, fs vfs.FS, name string, cut int) {
	t.Helper()
	f, err := fs.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	data, err := io.ReadAll(f)
	f.Close()
	if err != nil || len(data) <= cut {
		t.Fatalf("read %s: %d bytes, %v", name, len(data), err)
	}
	w, err := fs.Create(name, vfs.WriteCategoryUnspecified)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(data[:len(data)-cut]); err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(w.Sync(), w.Close()); err != nil {
		t.Fatal(err)
	}
}

// rawPebble opens the log's Pebble DB directly, to damage it.
func rawPebble(t *testing.T, fs vfs.FS) (*pebble.DB, func()) {
	t.Helper()
	opts, err := testOpts(fs).withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	po, closer := opts.pebbleOptions(false)
	db, err := pebble.Open(opts.Dir, po)
	if err != nil {
		t.Fatal(err)
	}
	return db, func() {
		if err := errors.Join(db.Close(), closer.Close()); err != nil {
			t.Fatal(err)
		}
	}
}

// TestCorruptRecordStopsOpen damages one record through Pebble and checks
// that Open refuses with an error naming the dir and the seq.
func TestCorruptRecordStopsOpen(t *testing.T) {
	badCRC := encodeFrame(payloadFor(3))
	badCRC[len(badCRC)-1] ^= 0xff
	badVersion := encodeFrame(payloadFor(3))
	badVersion[0] = 9
	for name, damage := range map[string]func(*pebble.DB) error{
		"bad checksum":    func(db *pebble.DB) error { return db.Set(recordKey(3), badCRC, pebble.Sync) },
		"unknown version": func(db *pebble.DB) error { return db.Set(recordKey(3), badVersion, pebble.Sync) },
		"gap":             func(db *pebble.DB) error { return db.Delete(recordKey(3), pebble.Sync) },
	} {
		t.Run(name, func(t *testing.T) {
			fs := vfs.NewMem()
			l := mustOpen(t, testOpts(fs))
			for i := range 5 {
				appendDurable(t, l, payloadFor(uint64(i+1)))
			}
			_ = l.Close()
			db, closeDB := rawPebble(t, fs)
			if err := damage(db); err != nil {
				t.Fatal(err)
			}
			closeDB()
			_, err := Open(testOpts(fs))
			if !IsCorrupt(err) {
				t.Fatalf("Open = %v, want a corruption error", err)
			}
			for _, want := range []string{"seq 3", "dir data"} {
				if !strings.Contains(err.Error(), want) {
					t.Fatalf("error %q does not contain %q", err, want)
				}
			}
		})
	}
}

// TestScanFindsCorruption damages a record under an open log: Scan reports
// it with the seq instead of handing out a bad payload.
func TestScanFindsCorruption(t *testing.T) {
	l := mustOpen(t, testOpts(vfs.NewMem()))
	for i := range 3 {
		appendDurable(t, l, payloadFor(uint64(i+1)))
	}
	bad := encodeFrame([]byte("rotten"))
	bad[2] ^= 1
	if err := l.db.Set(recordKey(2), bad, pebble.Sync); err != nil {
		t.Fatal(err)
	}
	var seen []uint64
	err := l.Scan(0, 3, func(seq uint64, _ []byte) error {
		seen = append(seen, seq)
		return nil
	})
	if !IsCorrupt(err) || !strings.Contains(err.Error(), "seq 2") || len(seen) != 1 {
		t.Fatalf("Scan = %v after %v, want corruption at seq 2 after [1]", err, seen)
	}
}

// TestCommitFailureMakesLogUnusable injects a write error into Pebble's WAL.
// Pebble reports it through Logger.Fatalf; with an Exit that returns (as in
// tests) the committer turns it into a failure of the log.
func TestCommitFailureMakesLogUnusable(t *testing.T) {
	var broken atomic.Bool
	fs := errorfs.Wrap(vfs.NewMem(), errorfs.InjectorFunc(func(op errorfs.Op) error {
		if broken.Load() && strings.HasSuffix(op.Path, ".log") && op.Kind.ReadOrWrite() == errorfs.OpIsWrite {
			return errorfs.ErrInjected
		}
		return nil
	}))
	var exitCode atomic.Int64
	opts := testOpts(fs)
	opts.Exit = func(code int) { exitCode.Store(int64(code)) }
	l, err := Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	good := appendDurable(t, l, []byte("ok"))
	broken.Store(true)
	seq, err := l.Append([]byte("doomed"))
	if err != nil {
		t.Fatal(err)
	}
	err = l.WaitDurable(context.Background(), seq)
	if err == nil || !strings.Contains(err.Error(), "injected") || !strings.Contains(err.Error(), "failed") {
		t.Fatalf("WaitDurable of the failed commit = %v, want the failure", err)
	}
	if exitCode.Load() != 1 {
		t.Fatalf("Exit called with %d, want 1", exitCode.Load())
	}
	if _, err := l.Append([]byte("later")); err == nil || !strings.Contains(err.Error(), "injected") {
		t.Fatalf("Append after the failure = %v", err)
	}
	if err := l.WaitDurable(context.Background(), good); err != nil {
		t.Fatalf("WaitDurable of a record durable before the failure = %v", err)
	}
	if err := l.PutMeta("x", nil); err == nil {
		t.Fatal("PutMeta after the failure succeeded")
	}
	t.Logf("Close after the failure: %v", l.Close())
}
