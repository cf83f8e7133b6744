// Package logbuf is a buffer that goroutines write to while a test reads
// it: a node's logger, or a child process's output, in one place that a
// test polls (with waitfor.Cond) for the line it expects:
//
//	var logs logbuf.Buffer
//	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
//	waitfor.Cond(t, 10*time.Second, "the warning", func() bool { return strings.Contains(logs.String(), "clock is") })
//
// A bytes.Buffer alone races: the writers and the reader share its slice.
package logbuf

import (
	"bytes"
	"sync"
)

// Buffer is a bytes.Buffer safe for concurrent Write and String. The zero
// value is empty and ready.
type Buffer struct {
	mu  sync.Mutex // protects buf
	buf bytes.Buffer
}

// Write appends p.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String is everything written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
