package wal

import (
	"errors"
	"fmt"

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
