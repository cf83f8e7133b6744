package wal

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
)

// Log is a node's local log. All methods are safe for concurrent use.
type Log struct {
	opts        Options // with defaults
	db          *pebble.DB
	fsCloser    io.Closer // disk-health checker around opts.FS
	dirLock     io.Closer // the data dir's own lock (dirlock.go), released by Close
	writeOpts   *pebble.WriteOptions
	incarnation string
	log         *slog.Logger
	// mark records how far records are durable, for the next Open (see
	// durableMark). Written by the committer only, after Open. Nil when
	// readOnly.
	mark *durableMark
	// readOnly is set for Options.ReadOnly, and for the check Open makes
	// before it opens for writing.
	readOnly bool

	// lastSeq is written only under mu; read without it by LastSeq.
	lastSeq atomic.Uint64
	// durableSeq is written only by the committer, after Commit returned.
	durableSeq atomic.Uint64
	// settledSeq is written only under settleMu.
	settledSeq atomic.Uint64
	// recovered is the last seq the log held when it opened (set once, in
	// recover); sent the highest seq this process sent to be settled
	// (NoteSettleSent). Together they bound how far the ledger's mark may
	// legitimately be ahead of settledSeq (Vouched).
	recovered uint64
	sent      atomic.Uint64
	// notify is closed and replaced whenever durableSeq advances or the log
	// fails or closes. Waiters load it before they check their condition.
	notify atomic.Pointer[chan struct{}]
	// stopped, once set (under mu), is why waiters stop waiting: the failure,
	// or ErrClosed after the committer drained the queue and exited.
	stopped atomic.Pointer[error]

	commits     atomic.Uint64
	fsyncs      atomic.Uint64
	appendWaits atomic.Uint64

	mu sync.Mutex // protects the fields below, down to the blank line
	// queue holds record batches not yet taken by the committer, oldest
	// first; Append fills the last one.
	queue []*pendingBatch
	// pendingBytes counts bytes queued or being committed.
	pendingBytes int
	// spare holds committed chunk buffers for reuse.
	spare [][]byte
	// failure, once set, makes the log unusable. It names the failed commit.
	failure error
	// closing is set when Close begins: Append refuses, the committer drains
	// the queue and exits.
	closing bool
	// work wakes the committer: queue not empty, or closing.
	work sync.Cond
	// space wakes blocked Appends: pendingBytes fell, or failure, or closing.
	space sync.Cond

	// settleMu serializes Settle so that the settled mark only moves forward.
	settleMu sync.Mutex
	// marks tracks cumulative record bytes for Stats.Bytes.
	marks byteMarks

	// users counts calls that use db outside the committer; Close waits for
	// them before it closes db. Add happens only under mu while !closing.
	users     sync.WaitGroup
	done      chan struct{} // closed when the committer exits
	closeOnce sync.Once
	closeErr  error
}

// Open opens or creates the log in opts.Dir. It validates the frame of every
// unsettled record, so that real corruption is found at start, and resumes
// the sequence after max(last record, settled mark).
func Open(opts Options) (*Log, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	if never := neverInitialized(opts.FS, opts.Dir); never != "" {
		// NB: before the damage checks: a first start that failed before
		// it wrote anything (a full disk) leaves Pebble files that read as
		// damaged, and their remedy (quotad revoke) was for records this
		// dir never held.
		return nil, fmt.Errorf("wal: data dir %s was never initialized: it holds %s but no log file, sstable or %s, so no record was "+
			"ever written to it (a first start that failed, on a full disk say); remove the dir and start the node again",
			opts.Dir, never, durableMarkName)
	}
	if markers := missingMarkers(opts.FS, opts.Dir); len(markers) > 0 {
		// NB: before any pebble.Open: a read-write one takes the dir for
		// an empty one and creates a new DB over the old MANIFEST, losing
		// every record in it. Both markers are named at once: touching
		// the manifest's alone led to Pebble's "database already exists
		// and is not pristine", with no remedy.
		paths := make([]string, len(markers))
		for i, m := range markers {
			paths[i] = opts.FS.PathJoin(opts.Dir, m)
		}
		return nil, fmt.Errorf("%w: dir %s: Pebble's marker files, empty files whose names say which MANIFEST is current and which "+
			"format the dir is in, are missing (%s), though the MANIFEST is there (a copy that skipped empty files?): create them "+
			"again (`touch %s`) and start again; keep the rest of the dir as it is",
			ErrCorrupt, opts.Dir, strings.Join(markers, ", "), strings.Join(paths, " "))
	}
	if (opts.AnyNode || opts.ReadOnly) && !hasManifest(opts.FS, opts.Dir) {
		return nil, fmt.Errorf("wal: %s is not a quotad data dir (no Pebble MANIFEST in it)", opts.Dir)
	}
	if !opts.ReadOnly {
		if other := foreignFiles(opts.FS, opts.Dir); other != "" {
			return nil, fmt.Errorf("wal: data dir %s is not empty and is not a quotad data dir (it holds %s and no Pebble MANIFEST): "+
				"give the node a new or empty directory (a volume's lost+found is fine), so that the log's files are not mixed with others",
				opts.Dir, other)
		}
		// Owner only: the log holds accounts, usage and key ids.
		if err := opts.FS.MkdirAll(opts.Dir, 0o700); err != nil {
			return nil, fmt.Errorf("wal: create dir %s: %w", opts.Dir, err)
		}
	}
	var dirLock io.Closer = io.NopCloser(nil)
	if !opts.ReadOnly {
		// NB: before anything opens Pebble, which writes to the dir.
		if dirLock, err = lockDataDir(opts); err != nil {
			return nil, err
		}
	}
	l, err := openDir(opts)
	if err != nil {
		return nil, errors.Join(err, dirLock.Close())
	}
	l.dirLock = dirLock
	return l, nil
}

// openDir is Open past its checks of the dir, with the dir locked.
func openDir(opts Options) (*Log, error) {
	seen, err := readDurableMark(opts.FS, opts.Dir)
	if err != nil {
		return nil, err
	}
	if opts.ReadOnly {
		l, err := openLog(opts, seen, true)
		if err != nil {
			return nil, err
		}
		go l.run() // idles: Append refuses; Close waits for it
		return l, nil
	}
	if seen.found {
		// Check read-only first. A read-write pebble.Open flushes what it
		// replayed and drops the WAL: refusing after it would destroy the
		// evidence of the damage, and the records after it.
		l, err := openLog(opts, seen, true)
		if err != nil {
			return nil, err
		}
		if err := l.closeDB(); err != nil {
			return nil, fmt.Errorf("wal: close %s after checking it: %w", opts.Dir, err)
		}
	}
	l, err := openLog(opts, seen, false)
	if err != nil {
		return nil, err
	}
	go l.run()
	return l, nil
}

// openLog opens Pebble in opts.Dir and recovers the log, without starting
// the committer. A read-only log leaves the dir as it is: Pebble replays its
// WAL into memory only, and neither the meta nor the durable mark is written.
func openLog(opts Options, seen markSeen, readOnly bool) (*Log, error) {
	po, fsCloser := opts.pebbleOptions(readOnly)
	db, err := pebble.Open(opts.Dir, po)
	if err != nil {
		if path, why := damagedOptions(opts.FS, opts.Dir, po); path != "" {
			// NB: before openError, whose remedy (an empty data dir) would
			// throw the unsettled charges away for a file of settings.
			err = &damagedFileError{
				msg: fmt.Sprintf("%s: dir %s: the Pebble options file %s does not read (%s); it holds settings only, no records: "+
					"move it out of the dir (Pebble writes a new one) and start the node again; keep the rest of the dir as it is",
					ErrCorrupt, opts.Dir, path, firstLine(why)),
				cause: err,
			}
			_ = fsCloser.Close()
			return nil, err
		}
		_ = fsCloser.Close()
		return nil, openError(opts, err)
	}
	l := newLog(opts, db, fsCloser)
	l.readOnly = readOnly
	if err := l.recover(seen); err != nil {
		return nil, errors.Join(err, l.closeDB())
	}
	return l, nil
}

// damagedOptions names dir's newest Pebble OPTIONS file when it does not
// read as options this log can open with (garbled settings, a comparer or
// merger name that is not ours), and why; "" when it reads or there is none.
func damagedOptions(fs vfs.FS, dir string, po *pebble.Options) (string, error) {
	names, err := fs.List(dir)
	if err != nil {
		return "", nil
	}
	newest := ""
	for _, n := range names {
		if strings.HasPrefix(n, "OPTIONS-") && n > newest { // NB: zero-padded numbers sort as strings
			newest = n
		}
	}
	if newest == "" {
		return "", nil
	}
	path := fs.PathJoin(dir, newest)
	f, err := fs.Open(path)
	if err != nil {
		return "", nil
	}
	defer f.Close()
	data, err := io.ReadAll(f)
	if err != nil {
		return "", nil
	}
	o := po.Clone()
	o.EnsureDefaults() // NB: as Open does; CheckCompatibility reads the comparer's name
	if err := o.CheckCompatibility(dir, string(data)); err != nil {
		return path, err
	}
	return "", nil
}

// openError wraps an error of pebble.Open: corruption (of a WAL, the
// MANIFEST or an sstable) on one line wrapping ErrCorrupt, with the remedy.
func openError(opts Options, err error) error {
	if lockHeld(err) {
		lock := opts.FS.PathJoin(opts.Dir, "LOCK")
		if strings.Contains(err.Error(), "current process") {
			return fmt.Errorf("wal: data dir %s is already open in this process (its lock %s is held): close it first: %w",
				opts.Dir, lock, err)
		}
		return fmt.Errorf("wal: data dir %s is in use: another process holds its lock %s, most likely "+
			"another quotad serving it (or a quotad reconcile reading it); stop that process first "+
			"(`fuser -v %s` names it), and never run two nodes on one data dir: %w", opts.Dir, lock, lock, err)
	}
	if errors.Is(err, os.ErrPermission) {
		return fmt.Errorf("wal: data dir %s is not writable by this process's user (uid %d): give the dir and its files to that user "+
			"(chown -R %d %s) or, in Kubernetes, set the pod's securityContext.fsGroup: %w", opts.Dir, os.Getuid(), os.Getuid(), opts.Dir, err)
	}
	if errors.Is(err, os.ErrNotExist) {
		if m := missingManifest.FindStringSubmatch(err.Error()); m != nil {
			return &damagedFileError{
				msg: fmt.Sprintf("%s: dir %s: Pebble's MANIFEST %s, which lists the files that hold the records, is missing (deleted, "+
					"or not copied with the dir): restore it from a copy of the disk and start again; if it cannot be restored, %s",
					ErrCorrupt, opts.Dir, opts.FS.PathJoin(opts.Dir, m[1]), remedy(opts.NodeID)),
				cause: err,
			}
		}
		if m := missingTable.FindStringSubmatch(err.Error()); m != nil {
			sst := opts.FS.PathJoin(opts.Dir, m[1]+".sst")
			return &damagedFileError{
				msg: fmt.Sprintf("%s: dir %s: the sstable %s, which its MANIFEST lists, is missing (deleted, or not copied "+
					"with the dir); it holds records: restore that file from a copy of the disk and start again; "+
					"if it cannot be restored, %s", ErrCorrupt, opts.Dir, sst, remedy(opts.NodeID)),
				cause: err,
			}
		}
	}
	if m := malformedManifest.FindStringSubmatch(err.Error()); m != nil {
		return &damagedFileError{
			msg: fmt.Sprintf("%s: dir %s: Pebble's MANIFEST %s, which lists the files that hold the records, does not read (cut "+
				"short, or changed: a copy that did not finish, a full disk while copying); the sstables and WAL files it lists are "+
				"likely intact: restore that file from a copy of the disk and start again; if it cannot be restored, %s",
				ErrCorrupt, opts.Dir, opts.FS.PathJoin(opts.Dir, m[1]), remedy(opts.NodeID)),
			cause: err,
		}
	}
	if m := truncatedTable.FindStringSubmatch(err.Error()); m != nil {
		return &damagedFileError{
			msg: fmt.Sprintf("%s: dir %s: the sstable %s is %s bytes long, but its MANIFEST says %s: it was cut short or changed "+
				"(a copy that did not finish, a full disk while copying); it holds records: restore that file from a copy of the disk and "+
				"start again; if it cannot be restored, %s", ErrCorrupt, opts.Dir, m[1], m[2], m[3], remedy(opts.NodeID)),
			cause: err,
		}
	}
	if pebble.IsCorruptionError(err) && pebble.ExtractDataCorruptionInfo(err) == nil {
		// Not an sstable: most likely a WAL that Pebble knows was synced
		// past the damage. Name the file and offset if it is one.
		if where := describeWALs(opts.FS, opts.Dir); !strings.Contains(where, "read to their end") {
			return &damagedFileError{
				msg: fmt.Sprintf("%s: dir %s: open pebble: %s; %s",
					ErrCorrupt, opts.Dir, where, remedy(opts.NodeID)),
				cause: err,
			}
		}
	}
	return pebbleError(opts.Dir, opts.NodeID, "open pebble", err)
}

func newLog(opts Options, db *pebble.DB, fsCloser io.Closer) *Log {
	l := &Log{
		opts:      opts,
		db:        db,
		fsCloser:  fsCloser,
		writeOpts: pebble.Sync,
		log:       opts.Logger.With("dir", opts.Dir), // NB: the caller names the component,
		done:      make(chan struct{}),
	}
	if opts.NoSync {
		l.writeOpts = pebble.NoSync
	}
	l.work.L = &l.mu
	l.space.L = &l.mu
	ch := make(chan struct{})
	l.notify.Store(&ch)
	return l
}

// recover reads or creates the meta keys, scans the unsettled records,
// checks that they reach the durable mark seen before Pebble opened, and
// writes the mark anew.
func (l *Log) recover(seen markSeen) error {
	if err := l.loadMeta(); err != nil {
		return err
	}
	settled := l.settledSeq.Load()
	last, bytes, err := l.validateRecords(settled)
	if err != nil {
		return err
	}
	last = max(last, settled)
	if err := l.checkDurableMark(seen, last); err != nil {
		return err
	}
	l.lastSeq.Store(last)
	l.durableSeq.Store(last)
	l.recovered = last
	l.marks.reset(settled)
	l.marks.add(last, bytes)
	if l.readOnly {
		if l.opts.ReadOnly {
			l.log.Info("opened read-only", "node_id", l.opts.NodeID, "incarnation", l.incarnation,
				"settled", settled, "last", last, "unsettled_bytes", bytes)
		}
		return nil
	}
	// pebble.Open flushed what it replayed to sstables: records through
	// last are durable, whatever the WAL held unsynced.
	if l.mark, err = openDurableMark(l.opts.FS, l.opts.Dir, l.incarnation, last); err != nil {
		return err
	}
	l.log.Info("opened", "node_id", l.opts.NodeID, "incarnation", l.incarnation,
		"settled", settled, "last", last, "unsettled_bytes", bytes)
	return nil
}

// validateRecords checks every record after settled: its frame, and that the
// sequence has no gap. Records are committed in sequence order and Pebble
// recovers a prefix of its WAL, so a gap means lost data.
func (l *Log) validateRecords(settled uint64) (last uint64, bytes uint64, err error) {
	last = settled
	err = l.iterRecords(settled, ^uint64(0), func(seq uint64, payload []byte) error {
		if seq != last+1 {
			return corruptRecord(l.opts.Dir, last+1, errors.New("missing record (gap in sequence)"))
		}
		last = seq
		bytes += uint64(recordKeyLen + frameHeaderLen + len(payload))
		return nil
	})
	return last, bytes, err
}

// loadMeta checks the node id and format of an existing dir, or initializes
// a new one, and loads the incarnation and the settled mark.
func (l *Log) loadMeta() error {
	node, ok, err := l.getMeta(metaNodeID)
	if err != nil {
		return err
	}
	if !ok {
		_, markErr := l.opts.FS.Stat(l.opts.FS.PathJoin(l.opts.Dir, durableMarkName))
		if l.readOnly || markErr == nil {
			// Only a dir with a durable mark is checked read-only, and the
			// mark is written after the meta is durable: the meta (the
			// first records a dir gets) is gone, with whatever followed.
			if ssts, manifest := l.unlistedTables(); ssts != "" {
				return corruptKey(l.opts.Dir, "meta "+metaNodeID, fmt.Errorf("missing, though %s shows the dir in use; the sstables %s in the dir are "+
					"not listed in its MANIFEST %s, which was most likely cut short or replaced (a copy or restore that stopped early): the records "+
					"are probably in those sstables: restore %s from a copy of the disk first and start again, keeping the rest of the dir; "+
					"if it cannot be restored, %s", durableMarkName, ssts, manifest, l.opts.FS.PathJoin(l.opts.Dir, manifest), remedy(l.opts.NodeID)))
			}
			return corruptKey(l.opts.Dir, "meta "+metaNodeID, fmt.Errorf("missing, though %s shows the dir in use: its first records are gone "+
				"(a WAL damaged near its start, or a lost sstable or MANIFEST; %s); %s", durableMarkName, describeWALs(l.opts.FS, l.opts.Dir), remedy(l.opts.NodeID)))
		}
		if l.opts.AnyNode {
			return fmt.Errorf("wal: %s is not a quotad data dir (no node id in it)", l.opts.Dir)
		}
		return l.initMeta()
	}
	if l.opts.AnyNode {
		l.opts.NodeID = string(node)
	}
	if string(node) != l.opts.NodeID {
		return fmt.Errorf("%w: data dir %s belongs to node %q, not %q (--node-id, whose default is the host's name): start it as %q, "+
			"or give this node a data dir of its own",
			ErrNodeMismatch, l.opts.Dir, node, l.opts.NodeID, node)
	}
	if err := l.checkFormat(); err != nil {
		return err
	}
	inc, err := l.mustMeta(metaIncarnation)
	if err != nil {
		return err
	}
	l.incarnation = string(inc)
	settled, err := l.mustMeta(metaSettledSeq)
	if err != nil {
		return err
	}
	s, err := decodeU64(settled)
	if err != nil {
		return corruptKey(l.opts.Dir, "meta "+metaSettledSeq, err)
	}
	l.settledSeq.Store(s)
	return nil
}

// checkFormat refuses a dir written in another layout.
func (l *Log) checkFormat() error {
	v, err := l.mustMeta(metaFormat)
	if err != nil {
		return err
	}
	f, err := decodeU64(v)
	switch {
	case err != nil:
		return fmt.Errorf("%w: dir %s: its format meta value %x does not decode: %s", ErrCorrupt, l.opts.Dir, v, remedy(l.opts.NodeID))
	case f > formatVersion:
		return fmt.Errorf("wal: dir %s is in log format %d, written by a newer quotad; this build reads format %d: run that build or a later one "+
			"(never roll a node back below the build that last opened its data dir)", l.opts.Dir, f, formatVersion)
	case f < formatVersion:
		return fmt.Errorf("wal: dir %s is in log format %d, written by an older quotad; this build reads format %d: stop the node cleanly "+
			"with the build that wrote it (SIGTERM: everything settles), then start this build on an empty data dir", l.opts.Dir, f, formatVersion)
	}
	return nil
}

// mustMeta returns a meta value that every initialized dir has.
func (l *Log) mustMeta(name string) ([]byte, error) {
	v, ok, err := l.getMeta(name)
	if err == nil && !ok {
		err = corruptKey(l.opts.Dir, "meta "+name, errors.New("missing"))
	}
	return v, err
}

// initMeta writes the meta of a new dir in one synced batch. A crash before
// the batch is durable leaves a dir that the next Open initializes again.
func (l *Log) initMeta() error {
	inc, err := newIncarnation()
	if err != nil {
		return err
	}
	b := l.db.NewBatch()
	defer b.Close()
	for name, v := range map[string][]byte{
		metaNodeID:      []byte(l.opts.NodeID),
		metaIncarnation: []byte(inc),
		metaFormat:      encodeU64(formatVersion),
		metaSettledSeq:  encodeU64(0),
	} {
		if err := b.Set(prefixKey(prefixMeta, name), encodeFrame(v), nil); err != nil {
			return err
		}
	}
	if err := b.Commit(pebble.Sync); err != nil {
		return fmt.Errorf("wal: initialize %s: %w", l.opts.Dir, err)
	}
	l.incarnation = inc
	return nil
}

// newIncarnation returns a random 128-bit id in hex.
func newIncarnation() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("wal: make incarnation: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// Incarnation returns the random 128-bit hex id made when the dir was
// created. It is stable across reopens and differs for every new dir.
func (l *Log) Incarnation() string { return l.incarnation }

// NodeID returns the node id the dir belongs to.
func (l *Log) NodeID() string { return l.opts.NodeID }

// Dir returns the data dir.
func (l *Log) Dir() string { return l.opts.Dir }

// LastSeq returns the last sequence number assigned by Append (or recovered
// by Open).
func (l *Log) LastSeq() uint64 { return l.lastSeq.Load() }

// DurableSeq returns the sequence number through which records are durable.
// It advances only after Pebble's Commit returned: Pebble shows a write to
// readers before it is durable.
func (l *Log) DurableSeq() uint64 { return l.durableSeq.Load() }

// SettledSeq returns the settled mark: records up to it are deleted.
func (l *Log) SettledSeq() uint64 { return l.settledSeq.Load() }

// NoteSettleSent records that a settle of the records up to seq was sent to
// the ledger: it may have applied them even if its answer never came back.
func (l *Log) NoteSettleSent(seq uint64) {
	for {
		cur := l.sent.Load()
		if seq <= cur || l.sent.CompareAndSwap(cur, seq) {
			return
		}
	}
}

// Vouched is how far the ledger's settled mark for this incarnation can
// legitimately be ahead of SettledSeq: up to the records the log held when
// it opened (a crash between a ledger commit and the local mark), or up to
// what this process sent to be settled since (an answer lost). A ledger
// mark beyond it counts records this log took after it opened and never
// sent: the ledger settled other records under those seqs, so the data
// dir is older than the ledger (restored from a copy) or another process
// settles as this node.
func (l *Log) Vouched() uint64 { return max(l.recovered, l.sent.Load()) }

// acquire registers a call that uses db, or fails once Close has begun.
func (l *Log) acquire() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closing {
		return ErrClosed
	}
	l.users.Add(1)
	return nil
}

// release ends a call registered by acquire.
func (l *Log) release() { l.users.Done() }

// wake closes the notify channel and installs a new one.
func (l *Log) wake() {
	ch := make(chan struct{})
	close(*l.notify.Swap(&ch))
}

// Close commits what is queued (so its waiters get their answer), stops the
// committer and waits for it, waits for calls in progress, and closes Pebble.
// Later calls return the first call's result.
func (l *Log) Close() error {
	l.closeOnce.Do(func() { l.closeErr = l.close() })
	return l.closeErr
}

func (l *Log) close() error {
	l.mu.Lock()
	l.closing = true
	l.work.Broadcast()
	l.space.Broadcast()
	l.mu.Unlock()
	<-l.done
	l.mu.Lock()
	l.stopLocked(ErrClosed) // after the drain: waiters of drained records got nil
	l.mu.Unlock()
	l.wake()
	l.users.Wait()
	return errors.Join(l.closeDB(), l.dirLock.Close())
}

// closeDB closes Pebble, then the disk-health checker and the durable mark.
func (l *Log) closeDB() error {
	err := l.db.Close()
	return errors.Join(err, l.fsCloser.Close(), l.mark.close())
}

// WaitDurable returns nil once DurableSeq() >= seq. It returns an error if
// the log failed or closed before that, or when ctx is done. A record that is
// durable stays durable: WaitDurable returns nil for it even after a failure.
func (l *Log) WaitDurable(ctx context.Context, seq uint64) error {
	if l.opts.NoSync && seq <= l.lastSeq.Load() {
		// NoSync gives up durability: Pebble would only hold the record in a
		// process buffer, so a record queued here is as safe as it will get.
		// Acknowledge it now, unless the log already failed.
		if err := l.waitErr(); err != nil && l.durableSeq.Load() < seq {
			return fmt.Errorf("wal: wait for seq %d: %w", seq, err)
		}
		return nil
	}
	for {
		ch := *l.notify.Load()
		if l.durableSeq.Load() >= seq {
			return nil
		}
		if err := l.waitErr(); err != nil {
			// NB: the log stops after its last commit moved the durable
			// mark: read again, or a record made durable between the two
			// reads above was reported lost (CI caught it in
			// TestCloseDrainsWaiters).
			if l.durableSeq.Load() >= seq {
				return nil
			}
			return fmt.Errorf("wal: wait for seq %d: %w", seq, err)
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("wal: wait for seq %d: %w", seq, ctx.Err())
		}
	}
}

// waitErr returns why a waiter can stop waiting, or nil.
func (l *Log) waitErr() error {
	if p := l.stopped.Load(); p != nil {
		return *p
	}
	return nil
}

// stopLocked records why waiters stop waiting, keeping the first reason.
func (l *Log) stopLocked(err error) {
	l.stopped.CompareAndSwap(nil, &err)
}

// lockHeld reports whether err is Pebble's failure to take the LOCK file of
// a dir that another process (EAGAIN or EACCES from fcntl), or this one,
// holds.
func lockHeld(err error) bool {
	if _, ok := errors.AsType[*iofs.PathError](err); ok {
		// Creating the LOCK file failed (EACCES: the dir is not this
		// user's), which was read as "another process holds it": only
		// fcntl's own errors come bare.
		return false
	}
	return errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EACCES) ||
		strings.Contains(err.Error(), "lock held by current process")
}

// truncatedTable finds, in Pebble's error, an sstable whose size on disk
// is not the one its MANIFEST recorded (the first, when there are several).
var truncatedTable = regexp.MustCompile(`object size mismatch \(([^)]+)\): (\d+) \(disk\) != (\d+) \(MANIFEST\)`)

// malformedManifest finds, in Pebble's error, a MANIFEST that does not
// read as one (cut short to a few bytes: no record of the log files).
var malformedManifest = regexp.MustCompile(`malformed manifest file "(MANIFEST-\d+)"`)

// missingTable finds the number of the sstable in Pebble's error for a file
// its MANIFEST lists that is not in the dir.
var missingTable = regexp.MustCompile(`file (\d+) \(type sstable\) unknown`)

// missingManifest matches Pebble's error for a MANIFEST its marker names
// that is not there.
var missingManifest = regexp.MustCompile(`could not open manifest file "(MANIFEST-\d+)"`)

// neverInitialized says what Pebble files dir holds when it holds no WAL
// (*.log), no sstable and no durable mark: a dir a first start created and
// then failed in before it wrote anything (Pebble writes its WAL at open,
// and the log its mark right after), which holds no record. "" otherwise,
// or when there is nothing in it.
func neverInitialized(fs vfs.FS, dir string) string {
	names, err := fs.List(dir)
	if err != nil {
		return ""
	}
	var pebbleFiles []string
	for _, n := range names {
		switch kind := dataDirFile(n); {
		case kind == recordsFile:
			return ""
		case kind == bookkeepingFile:
			pebbleFiles = append(pebbleFiles, n)
		}
	}
	if len(pebbleFiles) == 0 {
		return ""
	}
	return strings.Join(pebbleFiles, ", ")
}

// unlistedTables names the sstables in the dir that the open DB does not
// list (its MANIFEST, the newest, is then the one named), or "" when every
// one is listed or they cannot be read.
func (l *Log) unlistedTables() (ssts, manifest string) {
	levels, err := l.db.SSTables()
	if err != nil {
		return "", ""
	}
	listed := map[string]bool{}
	for _, level := range levels {
		for _, t := range level {
			listed[t.BackingSSTNum.String()+".sst"] = true
		}
	}
	names, err := l.opts.FS.List(l.opts.Dir)
	if err != nil {
		return "", ""
	}
	var out []string
	for _, n := range names {
		switch {
		case strings.HasSuffix(n, ".sst") && pebbleRecordsFile.MatchString(n) && !listed[n]:
			out = append(out, n)
		case strings.HasPrefix(n, "MANIFEST-") && n > manifest: // NB: zero-padded numbers sort as strings
			manifest = n
		}
	}
	slices.Sort(out)
	return strings.Join(out, ", "), manifest
}

// missingMarkers returns the names Pebble's marker files would have when
// dir holds MANIFEST files but lacks them: the one naming the newest
// MANIFEST (without it Pebble takes the dir for an empty one), and the one
// naming the format, read from the newest OPTIONS file (this build's when
// there is none). Empty when dir has both, or no MANIFEST.
func missingMarkers(fs vfs.FS, dir string) []string {
	names, err := fs.List(dir)
	if err != nil {
		return nil
	}
	newest, options := "", ""
	haveManifest, haveFormat := false, false
	for _, n := range names {
		switch {
		case strings.HasPrefix(n, "marker.manifest."):
			haveManifest = true
		case strings.HasPrefix(n, "marker.format-version."):
			haveFormat = true
		case strings.HasPrefix(n, "MANIFEST-") && n > newest: // NB: zero-padded numbers sort as strings
			newest = n
		case strings.HasPrefix(n, "OPTIONS-") && n > options:
			options = n
		}
	}
	if newest == "" {
		return nil
	}
	var out []string
	if !haveManifest {
		out = append(out, "marker.manifest.000001."+newest)
	}
	if !haveFormat {
		format := formatMajorVersion
		if options != "" {
			if data, err := readSmallFile(fs, fs.PathJoin(dir, options)); err == nil {
				if m := optionsFormat.FindSubmatch(data); m != nil {
					if v, err := strconv.ParseUint(string(m[1]), 10, 32); err == nil {
						format = pebble.FormatMajorVersion(v)
					}
				}
			}
		}
		out = append(out, "marker.format-version.000001."+format.String())
	}
	return out
}

// optionsFormat finds the format a Pebble OPTIONS file names.
var optionsFormat = regexp.MustCompile(`(?m)^\s*format_major_version=(\d+)\s*$`)

// readSmallFile reads up to 1 MiB of name.
func readSmallFile(fs vfs.FS, name string) ([]byte, error) {
	f, err := fs.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, 1<<20))
}

// The kinds of file a data dir holds (dataDirFile).
const (
	otherFile       = iota // not a data dir's
	recordsFile            // holds records, or says how far they reach: a WAL, an sstable, a blob file, the durable mark
	bookkeepingFile        // Pebble's LOCK, MANIFEST, markers and OPTIONS
)

// dataDirFile says what kind of file name is in a data dir.
func dataDirFile(name string) int {
	switch {
	case pebbleRecordsFile.MatchString(name), name == durableMarkName:
		return recordsFile
	case name == "LOCK", strings.HasPrefix(name, "MANIFEST-"), strings.HasPrefix(name, "marker."), strings.HasPrefix(name, "OPTIONS-"),
		name == durableMarkName+markTempSuffix:
		return bookkeepingFile
	}
	return otherFile
}

// pebbleRecordsFile matches the names Pebble gives its WAL files, sstables
// and blob files (000002.log): a name that only ends so (app.log, in a log
// dir given as --data-dir) is not Pebble's.
var pebbleRecordsFile = regexp.MustCompile(`^[0-9]{6,}\.(log|sst|blob)$`)

// foreignFiles names, for a dir that holds no file of a data dir (Pebble's
// or the durable mark), the first few of its entries other than a volume's
// lost+found: a dir that holds other things (a mistyped --data-dir such as
// a home directory) is no data dir. "" for a dir that is missing, empty, or
// holds any file of a data dir (a damaged one is for the other checks).
func foreignFiles(fs vfs.FS, dir string) string {
	names, err := fs.List(dir)
	if err != nil {
		return ""
	}
	var other []string
	for _, n := range names {
		switch {
		case dataDirFile(n) != otherFile:
			return ""
		case n != "lost+found":
			other = append(other, n)
		}
	}
	slices.Sort(other)
	if len(other) > 3 {
		other = append(other[:3], fmt.Sprintf("%d more", len(other)-3))
	}
	return strings.Join(other, ", ")
}

// hasManifest reports whether dir holds a Pebble DB.
func hasManifest(fs vfs.FS, dir string) bool {
	names, err := fs.List(dir)
	if err != nil {
		return false
	}
	for _, n := range names {
		if strings.HasPrefix(n, "MANIFEST-") {
			return true
		}
	}
	return false
}
