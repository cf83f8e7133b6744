package wal

import (
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// The data dir's own lock. Pebble excludes a second process with an fcntl
// lock on the file LOCK in the dir, which it creates if missing: with LOCK
// deleted (by hand, or by a cleanup script) a second quotad created a new
// one, locked it and wrote a MANIFEST, sstables and the durable mark into
// the dir of a node still serving from it, before anything refused it.
// A lock on the directory itself cannot be deleted from under its holder.

// errDirLocked is flock's answer for a directory another open holds.
var errDirLocked = errors.New("the directory is locked")

// lockDataDir takes an exclusive lock on opts.Dir itself when the log is
// on the disk (a file system of tests in memory has no directory to lock).
// The lock is released by closing what it returns, or when the process
// ends. A dir another Open holds, in this process or another, is an error
// that names it.
func lockDataDir(opts Options) (io.Closer, error) {
	if !onDisk(opts.FS) {
		return io.NopCloser(nil), nil
	}
	c, err := lockDir(opts.Dir)
	switch {
	case errors.Is(err, errDirLocked):
		return nil, fmt.Errorf("wal: data dir %s is in use: another process holds its lock on the directory, most likely another "+
			"quotad serving it (or a node of this process); stop that process first (`fuser -v %s` names it), and never run "+
			"two nodes on one data dir", opts.Dir, opts.Dir)
	case err != nil:
		return nil, openError(opts, fmt.Errorf("lock data dir %s: %w", opts.Dir, err))
	}
	return c, nil
}

// onDisk reports whether fs is the operating system's file system, under
// wrappers that say what they wrap.
func onDisk(fs vfs.FS) bool {
	for {
		if fs == vfs.Default {
			return true
		}
		u, ok := fs.(interface{ Unwrap() vfs.FS })
		if !ok || u.Unwrap() == nil {
			return false
		}
		fs = u.Unwrap()
	}
}

// dirFile is an open directory holding a lock.
type dirFile struct{ f *os.File }

func (d dirFile) Close() error { return d.f.Close() } // NB: closing releases the lock
