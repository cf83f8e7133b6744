package wal

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/quotaring/quotaring/internal/dirsnap"
)

// writeDurable opens a log on real files in dir, appends n records (one
// commit each, every one acknowledged), and copies the data dir while the
// log is still open, as an operator copies the dir of a node killed with
// SIGKILL. It returns the copy.
func writeDurable(t *testing.T, dir string, n int) string {
	t.Helper()
	l := mustOpen(t, Options{Dir: dir, NodeID: "node-1"})
	for i := range n {
		appendDurable(t, l, payloadFor(uint64(i+1)))
	}
	crashed := filepath.Join(t.TempDir(), "crashed")
	if err := os.CopyFS(crashed, os.DirFS(dir)); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return crashed
}

// stoppedDir makes a data dir on real files whose log took n records (one
// commit each, every one acknowledged) and then closed cleanly.
func stoppedDir(t *testing.T, n int) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "data")
	l := mustOpen(t, Options{Dir: dir, NodeID: "node-1"})
	for i := range n {
		appendDurable(t, l, payloadFor(uint64(i+1)))
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return dir
}

// overwrite writes n bytes of 0xA5 at off in name.
func overwrite(t *testing.T, name string, off int64, n int) {
	t.Helper()
	f, err := os.OpenFile(name, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	junk := []byte(strings.Repeat("\xa5", n))
	if _, err := f.WriteAt(junk, off); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestDamagedLogMiddleStopsOpen overwrites 32 bytes in the middle of the
// Pebble WAL that holds acknowledged records. With 60 records the WAL is one
// 32 KiB block: Pebble replays the records before the damage and treats the
// rest as a torn tail, and the durable mark must catch it. With 1500 it
// spans blocks, and Pebble itself reports corruption. Either way Open must
// refuse, on one line naming the WAL file and what to do, and leave the dir
// as it was.
func TestDamagedLogMiddleStopsOpen(t *testing.T) {
	for _, n := range []int{60, 1500} {
		t.Run(fmt.Sprintf("records=%d", n), func(t *testing.T) {
			crashed := writeDurable(t, filepath.Join(t.TempDir(), "data"), n)
			name := newestWALFile(t, crashed)
			fi, err := os.Stat(name)
			if err != nil {
				t.Fatal(err)
			}
			off := fi.Size() / 3
			overwrite(t, name, off, 32)
			t.Logf("damaged %s (%d bytes) at offset %d", filepath.Base(name), fi.Size(), off)

			before := dirsnap.Take(t, crashed)
			l, err := Open(Options{Dir: crashed, NodeID: "node-1"})
			if err == nil {
				last := l.LastSeq()
				_ = l.Close()
				t.Fatalf("Open succeeded on a log damaged in the middle: recovered %d of %d acknowledged records", last, n)
			}
			if !IsCorrupt(err) {
				t.Fatalf("Open = %v, want a corruption error", err)
			}
			for _, want := range []string{crashed, filepath.Base(name), "quotad revoke --node node-1"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not name %q", err, want)
				}
			}
			if strings.Contains(err.Error(), "\n") {
				t.Errorf("error has more than one line:\n%s", err)
			}
			before.Unchanged(t, crashed, "the refused Open")
			t.Log(err)
		})
	}
}

// TestTornTailOpensSilently cuts the final commit of a real Pebble WAL,
// as a crash during its write and before its fsync returned does: its
// record was never acknowledged, so the durable mark stops before it. Open
// must succeed with every earlier record, and reassign the torn seq. The
// same cut with the mark past the final commit (its record acknowledged)
// must be refused: what tells the two apart is the mark.
func TestTornTailOpensSilently(t *testing.T) {
	for _, acked := range []bool{false, true} {
		t.Run(map[bool]string{false: "never acknowledged", true: "acknowledged"}[acked], func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "data")
			l := mustOpen(t, Options{Dir: dir, NodeID: "node-1"})
			for i := range 59 {
				appendDurable(t, l, payloadFor(uint64(i+1)))
			}
			markBefore := readFile(t, filepath.Join(dir, durableMarkName))
			appendDurable(t, l, payloadFor(60))
			crashed := filepath.Join(t.TempDir(), "crashed")
			if err := os.CopyFS(crashed, os.DirFS(dir)); err != nil {
				t.Fatal(err)
			}
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
			if !acked {
				// The crash came before the fsync of record 60 returned.
				writeFile(t, filepath.Join(crashed, durableMarkName), markBefore)
			}
			name := newestWALFile(t, crashed)
			fi, err := os.Stat(name)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(name, fi.Size()-3); err != nil {
				t.Fatal(err)
			}

			l, err = Open(Options{Dir: crashed, NodeID: "node-1"})
			if acked {
				if err == nil {
					_ = l.Close()
					t.Fatal("Open succeeded without the acknowledged record 60")
				}
				if !IsCorrupt(err) || !strings.Contains(err.Error(), "seq 60") {
					t.Fatalf("Open = %v, want a corruption error naming seq 60", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Open after a torn tail: %v", err)
			}
			t.Cleanup(func() { _ = l.Close() })
			requireContiguous(t, readAll(t, l), 0, 59)
			if seq := appendDurable(t, l, []byte("again")); seq != 60 {
				t.Fatalf("next seq = %d, want 60", seq)
			}
		})
	}
}

func readFile(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func writeFile(t *testing.T, name string, b []byte) {
	t.Helper()
	if err := os.WriteFile(name, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestDamagedSSTStopsOpen garbles the sstable that holds the log's records
// and meta. Pebble reports on-disk corruption through Logger.Fatalf by
// default, which exits with a stack trace; Open must instead return one
// line that wraps ErrCorrupt and names the file and what to do, without
// calling Exit.
func TestDamagedSSTStopsOpen(t *testing.T) {
	dir, sst := flushedDir(t, 60)
	fi, err := os.Stat(sst)
	if err != nil {
		t.Fatal(err)
	}
	overwrite(t, sst, fi.Size()/3, 64)

	var logs bytes.Buffer
	var l *Log
	exited := false
	func() {
		defer func() {
			if r := recover(); r != nil {
				first, _, _ := strings.Cut(fmt.Sprint(r), "\n")
				t.Fatalf("Open panicked (Pebble's Fatalf): %s", first)
			}
		}()
		l, err = Open(Options{Dir: dir, NodeID: "node-1", Exit: func(int) { exited = true },
			Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	}()
	if exited {
		t.Error("Open called Exit on a damaged sstable")
	}
	if err == nil {
		_ = l.Close()
		t.Fatal("Open succeeded on a damaged sstable")
	}
	requireDamageNamed(t, err, sst, "quotad revoke --node node-1")
	if strings.Contains(logs.String(), "goroutine") || strings.Contains(logs.String(), ".go:") {
		t.Errorf("the log holds a stack trace at info level:\n%s", logs.String())
	}
	t.Log(err)
}

// flushedDir returns a closed log's dir whose n records are in one
// sstable (a read-write Open flushes the WAL it replays), and that sstable.
func flushedDir(t *testing.T, n int) (dir, sst string) {
	t.Helper()
	dir = filepath.Join(t.TempDir(), "data")
	l := mustOpen(t, Options{Dir: dir, NodeID: "node-1"})
	for i := range n {
		appendDurable(t, l, payloadFor(uint64(i+1)))
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l = mustOpen(t, Options{Dir: dir, NodeID: "node-1"})
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	ssts, err := filepath.Glob(filepath.Join(dir, "*.sst"))
	if err != nil || len(ssts) != 1 {
		t.Fatalf("want one sstable in %s, have %v (%v)", dir, ssts, err)
	}
	return dir, ssts[0]
}

// requireDamageNamed checks that err is one line wrapping ErrCorrupt that
// holds every one of wants.
func requireDamageNamed(t *testing.T, err error, wants ...string) {
	t.Helper()
	if err == nil || !IsCorrupt(err) {
		t.Fatalf("Open = %v, want a corruption error", err)
	}
	msg := err.Error()
	for _, want := range wants {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not name %q", msg, want)
		}
	}
	if strings.Contains(msg, "\n") {
		t.Errorf("error has more than one line:\n%s", msg)
	}
}

// requireBothRefuse opens dir as quotad serve and as quotad reconcile do,
// and requires each to refuse with a damage error holding every one of wants.
func requireBothRefuse(t *testing.T, dir string, wants ...string) {
	t.Helper()
	for name, o := range map[string]Options{
		"serve":     {Dir: dir, NodeID: "node-1"},
		"reconcile": {Dir: dir, AnyNode: true, ReadOnly: true},
	} {
		l, err := Open(o)
		if err == nil {
			_ = l.Close()
		}
		t.Run(name, func(t *testing.T) { requireDamageNamed(t, err, wants...) })
	}
}

// A deleted MANIFEST marker made Pebble take the dir for an empty one: the
// read-write Open of a dir without wal.durable as well created a new DB over
// the old MANIFEST and deleted the sstable of every record. Both opens now
// refuse, leave the dir as it is and say which file to create; with it
// created, every record is there.
func TestMissingManifestMarkerIsNamed(t *testing.T) {
	dir, _ := flushedDir(t, 40)
	markers, err := filepath.Glob(filepath.Join(dir, "marker.manifest.*"))
	if err != nil || len(markers) != 1 {
		t.Fatalf("want one MANIFEST marker in %s, have %v (%v)", dir, markers, err)
	}
	manifests, _ := filepath.Glob(filepath.Join(dir, "MANIFEST-*"))
	slices.Sort(manifests)
	for _, name := range []string{markers[0], filepath.Join(dir, "wal.durable")} {
		if err := os.Remove(name); err != nil {
			t.Fatal(err)
		}
	}
	before := dirsnap.Take(t, dir)
	touch := filepath.Join(dir, "marker.manifest.000001."+filepath.Base(manifests[len(manifests)-1]))
	requireBothRefuse(t, dir, "touch "+touch, "marker.manifest")
	if !before.Unchanged(t, dir, "a refused Open") {
		t.FailNow()
	}
	writeFile(t, touch, nil)
	l := mustOpen(t, Options{Dir: dir, NodeID: "node-1"})
	requireContiguous(t, readAll(t, l), 0, 40)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
}

// A copy that skipped empty files loses both of Pebble's markers: the
// error gave a touch for the MANIFEST's alone, and after it Pebble said
// "database already exists and is not pristine", with no remedy. Both are
// named, the format read from the OPTIONS file, and with both touched every
// record is there.
func TestMissingMarkersAreNamed(t *testing.T) {
	dir, _ := flushedDir(t, 40)
	markers, err := filepath.Glob(filepath.Join(dir, "marker.*"))
	if err != nil || len(markers) != 2 {
		t.Fatalf("want two markers in %s, have %v (%v)", dir, markers, err)
	}
	for _, m := range markers {
		if err := os.Remove(m); err != nil {
			t.Fatal(err)
		}
	}
	_, err = Open(Options{Dir: dir, NodeID: "node-1"})
	if err == nil {
		t.Fatal("Open succeeded without Pebble's markers")
	}
	var touched []string
	for _, m := range markers {
		// NB: the iteration in a marker's name may differ; the value is what counts.
		base := filepath.Base(m)
		parts := strings.SplitN(base, ".", 4)
		want := filepath.Join(dir, parts[0]+"."+parts[1]+".000001."+parts[3])
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %s", err, want)
		}
		touched = append(touched, want)
	}
	for _, name := range touched {
		writeFile(t, name, nil)
	}
	l := mustOpen(t, Options{Dir: dir, NodeID: "node-1"})
	requireContiguous(t, readAll(t, l), 0, 40)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
}

// A MANIFEST cut short (a copy or restore that stopped early) loses the
// sstable it listed: the error blamed the WAL and suggested an empty dir,
// though the records are intact in the sstable. It names the sstable the
// MANIFEST does not list, and the MANIFEST to restore first; the dir is
// left as it is.
func TestCutManifestIsNamed(t *testing.T) {
	dir, sst := flushedDir(t, 40)
	manifest, data := currentManifest(t, dir)
	writeFile(t, manifest, data[:50])
	before := dirsnap.Take(t, dir)
	requireBothRefuse(t, dir, filepath.Base(sst), "not listed in", filepath.Base(manifest), "restore")
	before.Unchanged(t, dir, "a refused Open")
}

// currentManifest is the path and content of dir's newest MANIFEST.
func currentManifest(t *testing.T, dir string) (string, []byte) {
	t.Helper()
	manifests, _ := filepath.Glob(filepath.Join(dir, "MANIFEST-*"))
	slices.Sort(manifests)
	if len(manifests) == 0 {
		t.Fatalf("no MANIFEST in %s", dir)
	}
	manifest := manifests[len(manifests)-1]
	data, err := os.ReadFile(manifest)
	if err != nil {
		t.Fatal(err)
	}
	return manifest, data
}

// A MANIFEST cut to a few bytes does not read at all: Pebble's "malformed
// manifest file" came with the generic remedy, which did not name the
// MANIFEST. It is named, to restore first.
func TestMalformedManifestIsNamed(t *testing.T) {
	dir, _ := flushedDir(t, 40)
	manifest, data := currentManifest(t, dir)
	writeFile(t, manifest, data[:20])
	before := dirsnap.Take(t, dir)
	requireBothRefuse(t, dir, "Pebble's MANIFEST "+manifest+", which lists the files that hold the records, does not read",
		"restore that file", "quotad revoke --node")
	before.Unchanged(t, dir, "a refused Open")
}

// A deleted sstable got Pebble's own message ("file 000005 (type sstable)
// unknown to the objstorage provider"): it is named, with the remedy.
func TestMissingSSTableIsNamed(t *testing.T) {
	dir, sst := flushedDir(t, 40)
	if err := os.Remove(sst); err != nil {
		t.Fatal(err)
	}
	requireBothRefuse(t, dir, sst, "is missing", "restore that file", "quotad revoke --node")
}

// A truncated sstable got Pebble's own message ("L6: 000019: object size
// mismatch (...): 50000 (disk) != 113754 (MANIFEST)") and no remedy: it is
// named, with both sizes and the remedy.
func TestTruncatedSSTableIsNamed(t *testing.T) {
	dir, sst := flushedDir(t, 40)
	fi, err := os.Stat(sst)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(sst, fi.Size()/2); err != nil {
		t.Fatal(err)
	}
	requireBothRefuse(t, dir, sst, fmt.Sprintf("is %d bytes long, but its MANIFEST says %d", fi.Size()/2, fi.Size()),
		"restore that file", "quotad revoke --node")
}

// TestReadOnlyLeavesDirUnchanged opens the dir of a killed node (records
// only in Pebble's WAL) with ReadOnly: the records are there to read,
// writes are refused, and every file of the dir is byte-identical after
// Close. A read-write Open would have flushed the WAL into an sstable.
func TestReadOnlyLeavesDirUnchanged(t *testing.T) {
	crashed := writeDurable(t, filepath.Join(t.TempDir(), "data"), 60)
	before := dirsnap.Take(t, crashed)

	l, err := Open(Options{Dir: crashed, AnyNode: true, ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	requireContiguous(t, readAll(t, l), 0, 60)
	if l.NodeID() != "node-1" || l.DurableSeq() != 60 {
		t.Errorf("read-only log: node %q, durable %d, want node-1 and 60", l.NodeID(), l.DurableSeq())
	}
	if _, err := l.Append([]byte("x")); err == nil {
		t.Error("Append to a read-only log succeeded")
	}
	if err := l.PutMeta("x", nil); err == nil {
		t.Error("PutMeta to a read-only log succeeded")
	}
	if err := l.Settle(60, nil); err == nil {
		t.Error("Settle of a read-only log succeeded")
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if !before.Unchanged(t, crashed, "a read-only Open") {
		t.FailNow()
	}
	if _, err := Open(Options{Dir: filepath.Join(t.TempDir(), "none"), NodeID: "n", ReadOnly: true}); err == nil {
		t.Error("a read-only Open of a dir that does not exist succeeded")
	}
}

// roFS is a read-only mount of the real file system: every call that would
// write fails with EROFS, as on a snapshot mounted read-only.
type roFS struct{ vfs.FS }

func erofs(op, name string) error { return &os.PathError{Op: op, Path: name, Err: syscall.EROFS} }

func (roFS) Create(name string, _ vfs.DiskWriteCategory) (vfs.File, error) {
	return nil, erofs("create", name)
}
func (roFS) Link(o, _ string) error { return erofs("link", o) }
func (roFS) OpenReadWrite(name string, _ vfs.DiskWriteCategory, _ ...vfs.OpenOption) (vfs.File, error) {
	return nil, erofs("open", name)
}
func (roFS) Remove(name string) error                 { return erofs("remove", name) }
func (roFS) RemoveAll(name string) error              { return erofs("remove", name) }
func (roFS) Rename(o, _ string) error                 { return erofs("rename", o) }
func (roFS) MkdirAll(dir string, _ os.FileMode) error { return erofs("mkdir", dir) }
func (roFS) ReuseForWrite(o, _ string, _ vfs.DiskWriteCategory) (vfs.File, error) {
	return nil, erofs("open", o)
}
func (roFS) Lock(name string) (io.Closer, error) { return nil, erofs("open", name) }

// A stopped node's dir on a read-only mount (a snapshot, a disk mounted
// for inspection) opens ReadOnly, without its lock and with a warning: it
// failed with "open .../LOCK: read-only file system". A read-write Open
// still fails there.
func TestReadOnlyOpensOnReadOnlyMount(t *testing.T) {
	crashed := writeDurable(t, filepath.Join(t.TempDir(), "data"), 25)
	var logs bytes.Buffer
	l, err := Open(Options{Dir: crashed, AnyNode: true, ReadOnly: true, FS: roFS{vfs.Default},
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatalf("read-only Open on a read-only mount: %v", err)
	}
	requireContiguous(t, readAll(t, l), 0, 25)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "read-only file system") || !strings.Contains(logs.String(), "level=WARN") {
		t.Errorf("no warning that the dir was read without its lock:\n%s", logs.String())
	}
	if _, err := Open(Options{Dir: crashed, NodeID: "node-1", FS: roFS{vfs.Default}}); err == nil {
		t.Error("a read-write Open on a read-only mount succeeded")
	}
}

// A full disk is fatal, as a failed fsync is: Pebble retries a failed
// flush at once and for ever, so a node on a full disk spun at full CPU
// and never served. Other background errors are only logged.
func TestFullDiskExits(t *testing.T) {
	for errno, want := range map[syscall.Errno]string{
		syscall.ENOSPC: "no space left on device for the data dir /var/lib/quotad",
		// A used-up disk quota and a file system remounted read-only after
		// a disk error spun Pebble the same way (logged only).
		syscall.EDQUOT: "the disk quota of the data dir /var/lib/quotad is used up",
		syscall.EROFS:  "the file system of the data dir /var/lib/quotad is read-only",
	} {
		var logs bytes.Buffer
		var codes []int
		o := Options{Dir: "/var/lib/quotad", Logger: slog.New(slog.NewTextHandler(&logs, nil)), Exit: func(c int) { codes = append(codes, c) }}
		l := o.eventListener()
		l.BackgroundError(fmt.Errorf("pebble: flush: %w", &os.PathError{Op: "write", Path: "/var/lib/quotad/000012.sst", Err: errno}))
		if len(codes) != 1 || codes[0] != 1 || !strings.Contains(logs.String(), want) {
			t.Fatalf("%v: exit codes %v, log:\n%s\nwant exit 1 and one line saying %q", errno, codes, logs.String(), want)
		}
	}
	var logs bytes.Buffer
	var codes []int
	o := Options{Dir: "/var/lib/quotad", Logger: slog.New(slog.NewTextHandler(&logs, nil)), Exit: func(c int) { codes = append(codes, c) }}
	l := o.eventListener()
	for range 100 { // Pebble retries at once: one line, not a hundred stack traces
		l.BackgroundError(fmt.Errorf("pebble: compaction: %w\n(1) attached stack trace\n  -- stack trace:", os.ErrPermission))
	}
	if len(codes) != 0 {
		t.Fatalf("another background error exited (%v); it is only logged", codes)
	}
	if n := strings.Count(logs.String(), "\n"); n != 1 || strings.Contains(logs.String(), "stack trace") {
		t.Fatalf("a hundred retries of another background error logged %d lines:\n%s\nwant one, without the stack trace", n, logs.String())
	}
}

// A garbled OPTIONS file (settings only, no records) is named, with the
// fix that keeps the records: move it out. With it moved, the log opens
// with every record.
func TestDamagedOptionsFileIsNamed(t *testing.T) {
	for name, garble := range map[string]func(path string){
		"garbage": func(path string) {
			if err := os.WriteFile(path, []byte("garbage"), 0o644); err != nil {
				t.Fatal(err)
			}
		},
		"a flipped byte in the merger's name": func(path string) {
			data, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			i := bytes.Index(data, []byte("merger=pebble.concatenate"))
			if i < 0 {
				t.Fatalf("no merger line in %s:\n%s", path, data)
			}
			overwrite(t, path, int64(i+len("merger=pebble.concat")), 1)
		},
	} {
		t.Run(name, func(t *testing.T) {
			crashed := writeDurable(t, filepath.Join(t.TempDir(), "data"), 20)
			opts, err := filepath.Glob(filepath.Join(crashed, "OPTIONS-*"))
			if err != nil || len(opts) == 0 {
				t.Fatalf("no OPTIONS file: %v", err)
			}
			slices.Sort(opts)
			path := opts[len(opts)-1]
			garble(path)
			_, err = Open(Options{Dir: crashed, NodeID: "node-1"})
			if err == nil || !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "the Pebble options file "+path+" does not read") ||
				!strings.Contains(err.Error(), "move it out of the dir") || strings.Contains(err.Error(), "empty data dir") {
				t.Fatalf("open with a garbled OPTIONS file: %v\nwant it named, with the fix that keeps the records", err)
			}
			if err := os.Rename(path, path+".bad"); err != nil {
				t.Fatal(err)
			}
			l := mustOpen(t, Options{Dir: crashed, NodeID: "node-1"})
			if l.LastSeq() != 20 {
				t.Fatalf("after moving the OPTIONS file out: %d records, want 20", l.LastSeq())
			}
		})
	}
}

// A WAL emptied from its start takes the meta (the first records a dir
// gets) with it: serve and reconcile both say the dir is damaged and give
// the remedy, not "no node id" or "not a quotad data dir".
func TestLostMetaIsDamage(t *testing.T) {
	crashed := writeDurable(t, filepath.Join(t.TempDir(), "data"), 20)
	name := newestWALFile(t, crashed)
	if err := os.Truncate(name, 0); err != nil {
		t.Fatal(err)
	}
	for what, o := range map[string]Options{
		"serve":     {Dir: crashed, NodeID: "node-1"},
		"reconcile": {Dir: crashed, AnyNode: true, ReadOnly: true},
	} {
		_, err := Open(o)
		if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "its first records are gone") ||
			!strings.Contains(err.Error(), "restore it from a copy of the disk") {
			t.Errorf("%s: open with its WAL %s emptied: %v\nwant ErrCorrupt saying the first records are gone, with the remedy", what, filepath.Base(name), err)
		}
	}
}

// TestUnreadableMarkWithShortLogStopsOpen: the durable mark is what tells
// a torn tail from lost acknowledged records. Unreadable (damaged, or
// written by a newer build), it was skipped with a warning, and a log cut
// short opened with the acknowledged records past the cut silently gone.
// Now an unreadable mark is accepted only when every WAL file reads to its
// end; otherwise Open refuses, naming the mark, the WAL and what to do.
func TestUnreadableMarkWithShortLogStopsOpen(t *testing.T) {
	for _, tc := range []struct {
		name    string
		mark    []byte
		cut     bool
		wantOK  bool
		want    string
		notWant string
	}{
		{"garbled mark, log whole", []byte("hello"), false, true, "", ""},
		// Garbage is damage, not a newer build's frame: "written by a
		// newer quotad" sent operators looking for a build that never was.
		{"garbled mark, log cut short", []byte("hello"), true, false, "unknown frame version 104", "newer quotad"},
		{"newer mark, log cut short", append([]byte{frameVersion + 1}, bytes.Repeat([]byte{0}, 20)...), true, false, "written by a newer quotad", ""},
		// An empty mark (a copy that skipped it) was read as no mark at
		// all: the check was off, and a cut log opened without a word.
		{"empty mark, log whole", []byte{}, false, true, "", ""},
		{"empty mark, log cut short", []byte{}, true, false, "empty", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			crashed := writeDurable(t, filepath.Join(t.TempDir(), "data"), 60)
			writeFile(t, filepath.Join(crashed, durableMarkName), tc.mark)
			name := newestWALFile(t, crashed)
			if tc.cut {
				fi, err := os.Stat(name)
				if err != nil {
					t.Fatal(err)
				}
				if err := os.Truncate(name, fi.Size()/3); err != nil {
					t.Fatal(err)
				}
			}
			before := dirsnap.Take(t, crashed)
			l, err := Open(Options{Dir: crashed, NodeID: "node-1"})
			if tc.wantOK {
				if err != nil {
					t.Fatalf("Open with only the mark damaged: %v", err)
				}
				defer l.Close()
				if l.LastSeq() != 60 {
					t.Fatalf("recovered %d of 60 records", l.LastSeq())
				}
				return
			}
			if err == nil {
				last := l.LastSeq()
				_ = l.Close()
				t.Fatalf("Open succeeded with an unreadable mark and a log cut short: recovered %d of 60 acknowledged records", last)
			}
			if !IsCorrupt(err) {
				t.Fatalf("Open = %v, want a corruption error", err)
			}
			for _, want := range []string{durableMarkName, filepath.Base(name), tc.want, "quotad revoke --node node-1", "move " + filepath.Join(crashed, durableMarkName) + " aside"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not name %q", err, want)
				}
			}
			if tc.notWant != "" && strings.Contains(err.Error(), tc.notWant) {
				t.Errorf("error %q says %q", err, tc.notWant)
			}
			before.Unchanged(t, crashed, "the refused Open")
			t.Log(err)
		})
	}
}

// TestPebbleFormatPinned: data dirs are written in a pinned Pebble format,
// not pebble.FormatNewest, which moves with every Pebble release: a build
// with a newer Pebble ratcheted every dir it opened, and the build before
// could no longer open them (a rollback failed). When Pebble gets a newer
// format, raise formatMajorVersion in a release of its own, or keep it and
// say so here.
func TestPebbleFormatPinned(t *testing.T) {
	if formatMajorVersion != pebble.FormatNewest {
		t.Fatalf("Pebble's newest format is %d, the data dirs' pinned one %d: decide (see formatMajorVersion)", pebble.FormatNewest, formatMajorVersion)
	}
}

// TestNewerPebbleFormatIsNamed: a dir written in a Pebble format this build
// does not know (a newer quotad opened it) is refused with an error that
// says so and what to do, not Pebble's raw one.
func TestNewerPebbleFormatIsNamed(t *testing.T) {
	dir := stoppedDir(t, 1)
	markers, err := filepath.Glob(filepath.Join(dir, "marker.format-version.*"))
	if err != nil || len(markers) != 1 {
		t.Fatalf("format marker: %v, %v", markers, err)
	}
	i := strings.LastIndexByte(markers[0], '.')
	if err := os.Rename(markers[0], markers[0][:i]+".099"); err != nil {
		t.Fatal(err)
	}
	l, err := Open(Options{Dir: dir, NodeID: "node-1"})
	if err == nil {
		l.Close()
		t.Fatal("Open succeeded on a dir in an unknown (newer) Pebble format")
	}
	if !strings.Contains(err.Error(), "written by a newer quotad") || !strings.Contains(err.Error(), dir) {
		t.Fatalf("Open = %v, want it to say a newer quotad wrote the dir", err)
	}
}

// TestNeverInitializedDirIsNamed: a first start that failed before it
// wrote anything (a full disk: Pebble got as far as its LOCK and an empty
// MANIFEST) left a dir whose next start said the log was damaged, then,
// after the suggested fix, to run quotad revoke for a node the ledger had
// never seen. It holds no record: the error says so, and to remove it.
func TestNeverInitializedDirIsNamed(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "LOCK"), nil)
	writeFile(t, filepath.Join(dir, "MANIFEST-000001"), nil)
	before := dirsnap.Take(t, dir)
	l, err := Open(Options{Dir: dir, NodeID: "node-1"})
	if err == nil {
		l.Close()
		t.Fatal("Open succeeded on a dir with an empty MANIFEST and no marker")
	}
	if !strings.Contains(err.Error(), "never initialized") || !strings.Contains(err.Error(), "remove the dir") || strings.Contains(err.Error(), "quotad revoke") {
		t.Fatalf("Open = %v, want it to say the dir was never initialized and to remove it", err)
	}
	before.Unchanged(t, dir, "the refused Open")
}

// TestMissingManifestIsNamed: a MANIFEST that its marker names, deleted,
// is named with what it holds and the remedy, not Pebble's raw error.
func TestMissingManifestIsNamed(t *testing.T) {
	dir := stoppedDir(t, 1)
	manifests, err := filepath.Glob(filepath.Join(dir, "MANIFEST-*"))
	if err != nil || len(manifests) == 0 {
		t.Fatalf("MANIFEST: %v, %v", manifests, err)
	}
	for _, m := range manifests {
		if err := os.Remove(m); err != nil {
			t.Fatal(err)
		}
	}
	l, err := Open(Options{Dir: dir, NodeID: "node-1"})
	if err == nil {
		l.Close()
		t.Fatal("Open succeeded without the MANIFEST")
	}
	if !IsCorrupt(err) || !strings.Contains(err.Error(), "MANIFEST") || !strings.Contains(err.Error(), "is missing") ||
		!strings.Contains(err.Error(), "quotad revoke --node node-1") {
		t.Fatalf("Open = %v, want a corruption error naming the missing MANIFEST and the remedy", err)
	}
}

// TestForeignDirRefused: a --data-dir that holds other things (a home
// directory, a mistyped path) was accepted, and Pebble's files were mixed
// with them. A volume's lost+found alone is fine.
func TestForeignDirRefused(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "home")
	if err := os.MkdirAll(filepath.Join(dir, "lost+found"), 0o755); err != nil {
		t.Fatal(err)
	}
	l := mustOpen(t, Options{Dir: dir, NodeID: "node-1"}) // lost+found only: a new volume
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(t.TempDir(), "other")
	if err := os.MkdirAll(other, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(other, "notes.txt"), []byte("mine"))
	// A name that only ends as Pebble's do is not Pebble's: a log dir
	// (/var/log/quotad) was taken for a data dir, and a rotation job
	// deleting *.log would have deleted the WAL.
	writeFile(t, filepath.Join(other, "app.log"), []byte("mine"))
	before := dirsnap.Take(t, other)
	if l, err := Open(Options{Dir: other, NodeID: "node-1"}); err == nil || !strings.Contains(err.Error(), "app.log, notes.txt") ||
		!strings.Contains(err.Error(), "not a quotad data dir") {
		if err == nil {
			l.Close()
		}
		t.Fatalf("Open of a dir holding notes.txt: %v, want a refusal naming it", err)
	}
	before.Unchanged(t, other, "the refused Open")
}

// TestUnwritableDirIsNotALockHeld: a data dir this user cannot write (a
// root-owned volume, a node run as another user) was reported as "another
// process holds its lock", and fuser named nobody. Creating the LOCK file
// failing is an access problem; fcntl's own EAGAIN or EACCES is a lock held.
func TestUnwritableDirIsNotALockHeld(t *testing.T) {
	dir := t.TempDir()
	opts := Options{Dir: dir, NodeID: "node-1", FS: vfs.Default}
	create := fmt.Errorf("pebble: %w", &iofs.PathError{Op: "open", Path: filepath.Join(dir, "LOCK"), Err: syscall.EACCES})
	err := openError(opts, create)
	if strings.Contains(err.Error(), "another process holds") || !strings.Contains(err.Error(), "is not writable by this process's user") ||
		!strings.Contains(err.Error(), "chown -R") {
		t.Errorf("LOCK not creatable: %v; want the access problem and its fix", err)
	}
	if err := openError(opts, syscall.EAGAIN); !strings.Contains(err.Error(), "another process holds its lock") {
		t.Errorf("fcntl's EAGAIN: %v; want the lock named as held", err)
	}
}

// A file in the data dir this user may not read (left by a run as root)
// gets the same fix as an unwritable dir, not Pebble's raw error, which
// read like damage.
func TestUnreadableFileNamesTheFix(t *testing.T) {
	err := pebbleError("/data", "node-1", `get meta "wal.node_id"`,
		fmt.Errorf("pebble: backing file 000005 error: %w", &iofs.PathError{Op: "open", Path: "/data/000005.sst", Err: syscall.EACCES}))
	if !strings.Contains(err.Error(), "not readable or writable by this process's user") || !strings.Contains(err.Error(), "chown -R") || errors.Is(err, ErrCorrupt) {
		t.Errorf("an unreadable sstable: %v; want the access problem and its fix, not damage", err)
	}
}

// A dir in another log format says whether a newer or an older quotad
// wrote it, and what to do, instead of the format's raw bytes.
func TestOtherLogFormatIsNamed(t *testing.T) {
	dir := t.TempDir()
	l := mustOpen(t, Options{Dir: dir, NodeID: "node-1"})
	if err := l.db.Set(prefixKey(prefixMeta, metaFormat), encodeFrame(encodeU64(formatVersion+1)), pebble.Sync); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if l, err := Open(Options{Dir: dir, NodeID: "node-1"}); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("in log format %d, written by a newer quotad", formatVersion+1)) {
		if err == nil {
			l.Close()
		}
		t.Fatalf("a dir in a newer format: %v", err)
	}
}
