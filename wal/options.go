package wal

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/quotaring/quotaring/internal/logsample"
)

// Defaults for the zero values of Options.
const (
	DefaultMaxBatchBytes   = 4 << 20
	DefaultMaxPendingBytes = 64 << 20
)

// Options configures Open. Only Dir and NodeID are required.
type Options struct {
	// Dir is the data dir. It is created if missing.
	Dir string

	// NodeID names the node that owns Dir. It is stored when the dir is
	// created; a later Open with another NodeID fails with an error wrapping
	// ErrNodeMismatch.
	NodeID string

	// AnyNode opens an existing dir whatever node it belongs to (NodeID then
	// reports the stored one): for tools that read a stopped node's log, such
	// as quotad reconcile. A dir that does not exist yet is refused.
	AnyNode bool

	// ReadOnly opens an existing dir without changing it: Pebble replays its
	// WAL into memory only (no flush, no new WAL, no OPTIONS file), and the
	// meta and the durable mark are not written. Append, Settle,
	// PutCheckpoints and PutMeta fail. For tools that inspect a stopped
	// node's dir, as evidence, such as quotad reconcile. A dir that does not
	// exist yet is refused. Pebble still takes the dir's LOCK, but for a dir
	// on a read-only file system (a snapshot or a disk mounted read-only for
	// inspection), which it opens without the lock, with a warning.
	ReadOnly bool

	// NoSync commits records with pebble.NoSync. FOR BENCHMARKS ONLY: Pebble
	// then keeps records in an in-process buffer, and a kill -9 loses records
	// whose WaitDurable already returned nil, which breaks G2. Since nothing
	// is durable then anyway, WaitDurable returns as soon as the record is
	// queued (DurableSeq, and so Scan and Settle, still follow the commits).
	// Settle, PutCheckpoints and PutMeta stay synced.
	NoSync bool

	// FS is the file system Pebble uses. If nil, vfs.Default. Tests pass
	// vfs.NewCrashableMem() and reopen from its CrashClone.
	FS vfs.FS

	// Logger receives Pebble's messages (with subsystem=pebble) and wal's
	// own (with dir); tag it with a component yourself. If nil, they are
	// discarded (never the process-wide slog.Default()).
	Logger *slog.Logger

	// Exit is called by the Logger given to Pebble when Pebble reports a fatal
	// error (for example a failed WAL fsync). If nil, os.Exit. If Exit returns
	// (tests), the Logger panics instead of returning: a Fatalf that returns
	// lets Pebble report a failed fsync as a successful commit.
	Exit func(code int)

	// MaxBatchBytes bounds the bytes of records the committer writes in one
	// commit; it is also the largest payload Append takes. If 0,
	// DefaultMaxBatchBytes.
	MaxBatchBytes int

	// MaxPendingBytes is the back-pressure bound: Append blocks while this many
	// bytes are queued or being committed. If 0, DefaultMaxPendingBytes.
	MaxPendingBytes int

	// OnCommit, if not nil, is called by the committer goroutine after each
	// successful commit of records, with the number of records, their bytes and
	// the duration of the Pebble commit. It must not block and must not call
	// Close.
	OnCommit func(records, bytes int, took time.Duration)
}

// withDefaults checks o and fills in its zero fields.
func (o Options) withDefaults() (Options, error) {
	if o.Dir == "" {
		return o, errors.New("wal: Options.Dir is required")
	}
	if o.NodeID == "" && !o.AnyNode {
		return o, errors.New("wal: Options.NodeID is required")
	}
	if o.MaxBatchBytes < 0 || o.MaxPendingBytes < 0 {
		return o, fmt.Errorf("wal: negative MaxBatchBytes (%d) or MaxPendingBytes (%d)",
			o.MaxBatchBytes, o.MaxPendingBytes)
	}
	if o.FS == nil {
		o.FS = vfs.Default
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Exit == nil {
		o.Exit = os.Exit
	}
	if o.MaxBatchBytes == 0 {
		o.MaxBatchBytes = DefaultMaxBatchBytes
	}
	if o.MaxPendingBytes == 0 {
		o.MaxPendingBytes = DefaultMaxPendingBytes
	}
	return o, nil
}

// diskSlowThreshold is how long a write may take before Pebble's disk-health
// checker reports it through EventListener.DiskSlow (Pebble's own default).
const diskSlowThreshold = 5 * time.Second

// pebbleOptions returns the Pebble options for a log, and the closer of the
// disk-health checker wrapped around o.FS, which the caller closes after the
// DB (or after a failed pebble.Open: Pebble would leak its goroutine then).
//
// The DB holds a short queue of records that are deleted at each settle, a
// few checkpoints and a few meta keys, so it needs little memory and no
// filters.
//
// A readOnly DB replays its WAL into memory and writes nothing; its Pebble
// info messages go to debug level, since a read-write open follows and
// repeats them.
// formatMajorVersion is the Pebble format every data dir is written in (see
// pebbleOptions).
const formatMajorVersion = pebble.FormatValueSeparation

func (o Options) pebbleOptions(readOnly bool) (*pebble.Options, io.Closer) {
	po := &pebble.Options{
		ReadOnly: readOnly,
		Logger:   pebbleLogger{log: o.Logger, exit: o.Exit, quiet: readOnly},
		// Pinned, so that a Pebble upgrade never changes the format of a dir
		// behind our back: Pebble ratchets every dir it opens up to this
		// version, and a dir ratcheted past what an older quotad's Pebble
		// knows cannot be opened by it (a rollback fails). Raise it in a
		// release of its own (TestPebbleFormatPinned fails when Pebble
		// gets a newer one), so that a rollback to the release before is
		// safe.
		FormatMajorVersion: formatMajorVersion,
		// Pebble commits a batch of at least half a memtable as a flushable
		// batch and rotates the memtable for it: keep our largest commit well
		// below that.
		// It is also large enough (64 MiB) that records are usually settled
		// and range-deleted before their memtable flushes, so the flush elides
		// them instead of writing them to an sstable (at 1M charges/s the log
		// takes about 100 MB/s).
		MemTableSize: uint64(max(64<<20, 4*o.MaxBatchBytes)),
		CacheSize:    8 << 20,
		// The WAL is what makes a commit durable: never disable it.
		DisableWAL: false,
		// No artificial delay between WAL syncs: the committer already
		// gathers everything that arrives during an fsync.
		WALMinSyncInterval: nil,
		// Table stats stay on (the default): they are how Pebble finds the
		// sstables wholly covered by a settle's DeleteRange and drops them
		// without rewriting them. No bloom filters (the default): records are
		// read by range, never by point lookups of missing keys.
	}
	po.EventListener = o.eventListener()
	base := o.FS
	if o.ReadOnly {
		base = readOnlyMountFS{FS: base, log: o.Logger}
	}
	fs, closer := vfs.WithDiskHealthChecks(base, diskSlowThreshold, nil,
		func(info vfs.DiskSlowInfo) { po.EventListener.DiskSlow(info) })
	po.FS = fs
	return po, closer
}

// readOnlyMountFS lets a ReadOnly log open a dir on a read-only file
// system, where Pebble cannot open its LOCK file for writing (EROFS): nothing
// writes the dir through this mount and the log writes nothing, so it goes on
// without the lock, and warns, since a writer elsewhere (the same disk
// mounted read-write on another host) would not be kept out.
type readOnlyMountFS struct {
	vfs.FS
	log *slog.Logger
}

func (fs readOnlyMountFS) Lock(name string) (io.Closer, error) {
	c, err := fs.FS.Lock(name)
	if errors.Is(err, syscall.EROFS) {
		fs.log.Warn("data dir is on a read-only file system: reading it without taking its lock; "+
			"make sure no node writes it through another mount", "lock", name)
		return noLock{}, nil
	}
	return c, err
}

// noLock is the lock of a dir on a read-only file system: there is none.
type noLock struct{}

func (noLock) Close() error { return nil }

// eventListener logs the Pebble events an operator needs.
func (o Options) eventListener() *pebble.EventListener {
	log := o.Logger.With("subsystem", "pebble")
	var others logsample.Sampler // the background errors that do not exit
	return &pebble.EventListener{
		BackgroundError: func(err error) {
			// Pebble retries a failed flush or compaction at once, for ever:
			// with the disk full, a node spun at full CPU, logged millions of
			// lines and never served. Exit on the errors that do not clear
			// by themselves, as for the storage errors Pebble calls fatal:
			// nothing durable is lost, and the next start replays the log.
			var why string
			switch {
			case errors.Is(err, syscall.ENOSPC):
				why = "no space left on device for the data dir " + o.Dir + ": free space there (df -h)"
			case errors.Is(err, syscall.EDQUOT):
				why = "the disk quota of the data dir " + o.Dir + " is used up: raise it or free space (quota -s, xfs_quota)"
			case errors.Is(err, syscall.EROFS):
				why = "the file system of the data dir " + o.Dir + " is read-only (remounted after a disk error?): check the kernel log (dmesg), repair and remount it read-write"
			}
			if why != "" {
				log.Error("fatal storage error, exiting: "+why+", then start the node again; it replays its log",
					"err", firstLine(err), "fatal", true)
				o.Exit(1)
				return
			}
			// Retried at once by Pebble too: one line a second, without the
			// stack trace each error carries.
			if ok, held := others.Allow(time.Now(), time.Second); ok {
				log.Error("background error", "err", firstLine(err), "similar_lines_held_back", held)
			}
		},
		DiskSlow: func(info pebble.DiskSlowInfo) {
			log.Warn("disk slow", "path", info.Path, "op", info.OpType.String(), "took", info.Duration)
		},
		WriteStallBegin: func(info pebble.WriteStallBeginInfo) {
			log.Warn("write stall begin", "reason", info.Reason)
		},
		WriteStallEnd: func() { log.Warn("write stall end") },
		// Pebble's default calls Logger.Fatalf, which exits with a stack
		// trace. The read that found the damage returns it instead: Open
		// and Scan turn it into one line naming the file (pebbleError).
		DataCorruption: func(info pebble.DataCorruptionInfo) {
			log.Error("on-disk corruption in the log: "+remedy(o.NodeID),
				"file", info.Path, "err", firstLine(info.Details))
			log.Debug("on-disk corruption detail", "file", info.Path, "detail", fmt.Sprintf("%+v", info.Details))
		},
	}
}

// pebbleLogger adapts slog to pebble.Logger.
type pebbleLogger struct {
	log   *slog.Logger
	exit  func(code int)
	quiet bool // Infof at debug level
}

// fatalError is the panic value of pebbleLogger.Fatalf when exit returns.
type fatalError struct{ msg string }

func (e fatalError) Error() string { return "wal: pebble fatal error: " + e.msg }

func (p pebbleLogger) Infof(format string, args ...any) {
	level := slog.LevelInfo
	if p.quiet {
		level = slog.LevelDebug
	}
	p.log.Log(context.Background(), level, fmt.Sprintf(format, args...), "subsystem", "pebble")
}

func (p pebbleLogger) Errorf(format string, args ...any) {
	p.log.Error(fmt.Sprintf(format, args...), "subsystem", "pebble")
}

// Fatalf logs, calls exit and, if exit returns, panics. It never returns:
// Pebble calls it, for example, when a WAL fsync fails, and carries on as if
// the commit succeeded if it returns.
//
// It logs the first line of Pebble's message at error level, and the rest
// (Pebble may append stack traces) at debug level only.
func (p pebbleLogger) Fatalf(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	first, rest, _ := strings.Cut(msg, "\n")
	p.log.Error("fatal storage error, exiting: "+first+
		" (check the disk: dmesg, free space; the node replays its log at the next start)",
		"subsystem", "pebble", "fatal", true)
	if rest != "" {
		p.log.Debug("fatal storage error detail", "subsystem", "pebble", "detail", rest)
	}
	p.exit(1)
	panic(fatalError{msg: first})
}
