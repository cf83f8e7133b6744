//go:build linux || darwin || freebsd || netbsd || openbsd || dragonfly

package wal

import (
	"errors"
	"io"
	"os"
	"syscall"
)

// lockDir takes flock(2) on the directory dir, exclusive and without
// waiting. flock locks belong to the open file, so a second open of the
// dir conflicts even in the same process, and they are separate from
// Pebble's fcntl lock on LOCK.
func lockDir(dir string) (io.Closer, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, errDirLocked
		}
		return nil, err
	}
	return dirFile{f}, nil
}
