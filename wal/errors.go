package wal

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/cockroachdb/pebble/v2"
)

var (
	// ErrCorrupt is wrapped by every error that reports a damaged value: a
	// frame whose checksum does not match, a frame with an unknown version, a
	// malformed key or a gap in the sequence. The wrapping error names the data
	// dir and the sequence number or key.
	ErrCorrupt = errors.New("wal: corrupt log")

	// ErrClosed is returned by calls made after Close began, and by WaitDurable
	// for records that Close did not commit.
	ErrClosed = errors.New("wal: log closed")

	// ErrNodeMismatch is wrapped by the error Open returns when the data dir
	// was created by another node id.
	ErrNodeMismatch = errors.New("wal: node id mismatch")
)

// IsCorrupt reports whether err reports corruption, found either by wal's
// own frame checks or by Pebble (a damaged sstable, MANIFEST or older WAL).
func IsCorrupt(err error) bool {
	return errors.Is(err, ErrCorrupt) || pebble.IsCorruptionError(err)
}

// corruptRecord returns an error wrapping ErrCorrupt for the record seq.
func corruptRecord(dir string, seq uint64, cause error) error {
	return fmt.Errorf("%w: dir %s: record seq %d: %w", ErrCorrupt, dir, seq, cause)
}

// corruptKey returns an error wrapping ErrCorrupt for a non-record key.
func corruptKey(dir, what string, cause error) error {
	return fmt.Errorf("%w: dir %s: %s: %w", ErrCorrupt, dir, what, cause)
}

// remedy says what an operator does about a data dir that lost or damaged
// records. node may be empty when the dir's node id is not known yet.
func remedy(node string) string {
	if node == "" {
		node = "ID"
	}
	return "do not serve from this data dir: restore it from a copy of the disk; if it cannot be " +
		"restored, keep it aside as evidence, list the unsettled charges it can still read with " +
		"`quotad reconcile --ledger DSN --data-dir DIR` (the revoke below means they are never settled: bill them by hand), " +
		"run `quotad revoke --node " + node + "` and start the node " +
		"with an empty data dir (a new incarnation; its unsettled charges are lost to the ledger, as for a lost disk)"
}

// damagedFileError reports on-disk corruption that Pebble found in one of
// its files, on one line; Pebble's own error (with its stack traces, for %+v)
// stays reachable through errors.Unwrap.
type damagedFileError struct {
	msg   string
	cause error
}

func (e *damagedFileError) Error() string   { return e.msg }
func (e *damagedFileError) Unwrap() []error { return []error{ErrCorrupt, e.cause} }

// pebbleError wraps err, returned by a Pebble call that did what, on the log
// of node in dir. On-disk corruption becomes one line wrapping ErrCorrupt
// that names the damaged file and what to do.
func pebbleError(dir, node, what string, err error) error {
	if errors.Is(err, os.ErrPermission) {
		return permissionError(dir, what, err)
	}
	if strings.Contains(err.Error(), "written in unknown format major version") {
		return fmt.Errorf("wal: %s in %s: the data dir was written by a newer quotad (a newer Pebble format: %s): run that build or a "+
			"later one; never roll a node back below the build that last opened its data dir", what, dir, firstLine(err))
	}
	if !pebble.IsCorruptionError(err) {
		return fmt.Errorf("wal: %s in %s: %w", what, dir, err)
	}
	file := "a Pebble file (see the log)"
	if info := pebble.ExtractDataCorruptionInfo(err); info != nil && info.Path != "" {
		file = info.Path
	}
	return &damagedFileError{
		msg: fmt.Sprintf("%s: dir %s: %s: %s is damaged (%s); %s",
			ErrCorrupt, dir, what, file, firstLine(err), remedy(node)),
		cause: err,
	}
}

// permissionError is a file of the data dir this process may not read or
// write: most often left by a quotad run once as another user (root).
func permissionError(dir, what string, err error) error {
	return fmt.Errorf("wal: %s in %s: a file of the data dir is not readable or writable by this process's user (uid %d), left by a run "+
		"as another user (root?): give the dir and its files to that user (chown -R %d %s) or, in Kubernetes, set the pod's "+
		"securityContext.fsGroup: %w", what, dir, os.Getuid(), os.Getuid(), dir, err)
}

// firstLine returns the first line of err's message: Pebble's errors may
// carry more lines, which belong in a debug log, not in a one-line summary.
func firstLine(err error) string {
	msg, _, _ := strings.Cut(err.Error(), "\n")
	return msg
}

// errReadOnly is the error of a write to a log opened with ReadOnly.
func errReadOnly(dir string) error {
	return fmt.Errorf("wal: %s is open read-only (Options.ReadOnly): writes are refused", dir)
}
