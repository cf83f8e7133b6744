package wal

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/cockroachdb/pebble/v2/vfs"
	pwal "github.com/cockroachdb/pebble/v2/wal"
)

// durableMarkName is the file, beside Pebble's, where the log writes how far
// its records are durable. Pebble ignores files it cannot parse the name of.
const durableMarkName = "wal.durable"

// A durable mark is the evidence that lets Open tell a torn tail from lost
// records. Pebble replays its WAL up to the first record it cannot read, and
// it can tell damage from a torn tail only by a later intact chunk that
// claims an fsync past the damage; it never looks at the rest of the 32 KiB
// block holding the damage, so damage in the last block of a WAL (all of a
// small one) is replayed as a torn tail: silently, without the acknowledged
// records after it.
//
// So the committer writes, after each commit returned and before any waiter
// is woken, the seq through which the records are durable, into a file
// outside Pebble's WAL. The claim is true whenever it is read: it is written
// only after the fsync that made it true. It is not fsynced per commit (that
// would double the fsyncs): a kill -9 keeps it (the page cache survives), a
// power loss may keep an older value, which only makes Open less strict.
// Settle and Close sync it. Open refuses a log that recovers less than the
// mark says was durable: those records were acknowledged and are gone.
type durableMark struct {
	f    vfs.File // nil when the log is read-only
	path string
	inc  string
	body []byte // incarnation | seq, reused
	buf  []byte // the frame, reused
	// failed is set after a write failed, so that the error is logged once.
	failed bool
}

// markSeen is what Open read from a durable mark file.
type markSeen struct {
	found bool   // the file exists and is not empty
	inc   string // the incarnation it belongs to
	seq   uint64 // records through seq were durable
	bad   error  // the file exists but its frame does not check
}

// readDurableMark reads the durable mark of dir, if any.
func readDurableMark(fs vfs.FS, dir string) (markSeen, error) {
	path := fs.PathJoin(dir, durableMarkName)
	f, err := fs.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return markSeen{}, nil
	}
	if errors.Is(err, os.ErrPermission) {
		return markSeen{}, permissionError(dir, "read "+durableMarkName, err)
	}
	if err != nil {
		return markSeen{}, fmt.Errorf("wal: read %s: %w", path, err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, 4096))
	if err != nil {
		return markSeen{}, fmt.Errorf("wal: read %s: %w", path, err)
	}
	if len(data) == 0 {
		// NB: openDurableMark never leaves one empty (it renames a written
		// one into place); a copy or restore that skipped empty-looking
		// files, or a truncation, did. Read as no mark, it turned the
		// check off: a cut log then opened with its acknowledged records
		// silently gone.
		return markSeen{found: true, bad: errors.New("empty (0 bytes): a copy or restore that left it out, or a truncation?")}, nil
	}
	body, err := decodeFrame(data)
	if err == nil && len(body) < 8 {
		err = errors.New("body shorter than its seq")
	}
	if err != nil {
		return markSeen{found: true, bad: err}, nil
	}
	seq, _ := decodeU64(body[len(body)-8:])
	return markSeen{found: true, inc: string(body[:len(body)-8]), seq: seq}, nil
}

// openDurableMark writes seq as the durable mark of dir, synced, and opens
// it for the next writes. The mark is written whole to a temporary file and
// renamed into place, so that it is never empty (readDurableMark takes an
// empty one for a damaged one) nor, after a crash, half of another
// incarnation's.
func openDurableMark(fs vfs.FS, dir, inc string, seq uint64) (*durableMark, error) {
	path := fs.PathJoin(dir, durableMarkName)
	tmp := path + markTempSuffix
	m := &durableMark{path: path, inc: inc}
	f, err := fs.Create(tmp, vfs.WriteCategoryUnspecified)
	if err != nil {
		return nil, fmt.Errorf("wal: create %s: %w", tmp, err)
	}
	m.f = f
	err = m.write(seq)
	if err == nil {
		err = f.Sync()
	}
	err = errors.Join(err, f.Close())
	if err == nil {
		err = fs.Rename(tmp, path)
	}
	if err == nil {
		err = syncDir(fs, dir)
	}
	if err != nil {
		return nil, fmt.Errorf("wal: write %s: %w", path, err)
	}
	if m.f, err = fs.OpenReadWrite(path, vfs.WriteCategoryUnspecified); err != nil {
		return nil, fmt.Errorf("wal: open %s: %w", path, err)
	}
	return m, nil
}

// markTempSuffix names the durable mark's temporary file while it is
// written (openDurableMark).
const markTempSuffix = ".tmp"

// write overwrites the mark with seq, without fsync. The frame has a fixed
// size for an incarnation, so a later write covers an earlier one.
func (m *durableMark) write(seq uint64) error {
	m.body = append(append(m.body[:0], m.inc...), encodeU64(seq)...)
	m.buf = appendFrame(m.buf[:0], checksum(m.body), m.body)
	_, err := m.f.WriteAt(m.buf, 0)
	return err
}

// sync fsyncs the mark.
func (m *durableMark) sync() error {
	if m == nil || m.f == nil {
		return nil
	}
	return m.f.Sync()
}

// close syncs and closes the mark.
func (m *durableMark) close() error {
	if m == nil || m.f == nil {
		return nil
	}
	return errors.Join(m.f.Sync(), m.f.Close())
}

// syncDir fsyncs dir, so that a file created in it stays.
func syncDir(fs vfs.FS, dir string) error {
	d, err := fs.OpenDir(dir)
	if err != nil {
		return err
	}
	return errors.Join(d.Sync(), d.Close())
}

// checkDurableMark compares what the log recovered (records through last)
// with what the mark says was durable before the node stopped.
func (l *Log) checkDurableMark(seen markSeen, last uint64) error {
	switch {
	case !seen.found:
		return nil // a new dir, or one written before marks existed
	case seen.bad != nil:
		// The mark cannot say how far the log was durable. That is fine
		// when every WAL file reads to its end (only the mark was damaged),
		// but not when one stops early: acknowledged records may be
		// beyond that point, and serving would lose them silently.
		where := describeWALs(l.opts.FS, l.opts.Dir)
		if strings.Contains(where, "read to their end") {
			l.log.Warn("durable mark unreadable, not checked; the log's WAL files read to their end", "file", durableMarkName, "err", seen.bad)
			return nil
		}
		return fmt.Errorf("%w: dir %s: %s, which says how far the log was durable (and acknowledged), is unreadable (%v), "+
			"and a WAL file does not read to its end: %s. After a crash a WAL often ends so (Pebble reuses WAL files), and one cut "+
			"short looks the same: with the mark unreadable, nothing here can tell whether acknowledged records were lost. If this dir "+
			"was only stopped by a crash (kill -9, a machine crash) and was not copied, cut or restored, move %s aside (keep it) and "+
			"start again: the node starts from what the log holds. Otherwise %s",
			ErrCorrupt, l.opts.Dir, durableMarkName, markProblem(seen.bad), where,
			l.opts.FS.PathJoin(l.opts.Dir, durableMarkName), remedy(l.opts.NodeID))
	case seen.inc != l.incarnation:
		l.log.Warn("durable mark of another incarnation, not checked", "file", durableMarkName,
			"mark_incarnation", seen.inc, "mark_seq", seen.seq)
		return nil
	case seen.seq <= last:
		return nil
	}
	return fmt.Errorf("%w: dir %s: records through seq %d were durable, and acknowledged, before "+
		"the node stopped (%s says so), but the log recovers only through seq %d: %s; "+
		"records %d..%d are gone from the log, and with them this dir's own record of what was settled: "+
		"those the ledger's settled mark for incarnation %s covers were billed (quotad admin nodes, SETTLED SEQ), "+
		"the rest are lost; %s",
		ErrCorrupt, l.opts.Dir, seen.seq, durableMarkName, last, describeWALs(l.opts.FS, l.opts.Dir),
		last+1, seen.seq, l.incarnation, remedy(l.opts.NodeID))
}

// markProblem says what is wrong with an unreadable durable mark; a frame
// version above this build's was written by a newer quotad.
func markProblem(err error) string {
	// NB: only a version a few above this build's: a garbage first byte
	// is any of 256, and "newer quotad" sent operators after a build that
	// never was.
	if v, ok := errors.AsType[frameVersionError](err); ok && byte(v) > frameVersion && byte(v) <= frameVersion+8 {
		return fmt.Sprintf("%v: written by a newer quotad, run that build or a later one", err)
	}
	return err.Error()
}

// describeWALs says where Pebble's WAL files in dir stop being readable: the
// file and the offset of the first record it cannot read, or that they read
// to their end (then records are missing for another reason, such as a
// deleted or replaced WAL file).
func describeWALs(fs vfs.FS, dir string) string {
	logs, err := pwal.Scan(pwal.Dir{FS: fs, Dirname: dir})
	if err != nil {
		return fmt.Sprintf("cannot list its WAL files: %v", err)
	}
	var stops []string
	for _, ll := range logs {
		if s := readToEnd(fs, ll); s != "" {
			stops = append(stops, s)
		}
	}
	if len(stops) == 0 {
		return fmt.Sprintf("Pebble's %d WAL file(s) read to their end (a WAL file missing or replaced?)", len(logs))
	}
	return strings.Join(stops, "; ")
}

// readToEnd reads every record of ll and returns "" when it ends cleanly, or
// which file stops at which offset, and why.
func readToEnd(fs vfs.FS, ll pwal.LogicalLog) string {
	r := ll.OpenForRead()
	defer r.Close()
	for {
		_, off, err := r.NextRecord()
		if errors.Is(err, io.EOF) {
			return ""
		}
		if err != nil {
			size := ""
			if fi, serr := fs.Stat(off.PhysicalFile); serr == nil {
				size = fmt.Sprintf(" of %d bytes", fi.Size())
			}
			return fmt.Sprintf("Pebble's WAL %s is unreadable from offset %d%s (%v)",
				off.PhysicalFile, off.Physical, size, err)
		}
	}
}
