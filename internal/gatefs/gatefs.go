// Package gatefs lets a test hold the fsync of Pebble's WAL files, to put a
// log's commit (and so every caller waiting for durability) in a known
// state: a disk that stalls, exactly when the test says.
//
//	fs := gatefs.New(vfs.NewMem())
//	l, _ := wal.Open(wal.Options{Dir: "data", NodeID: "n1", FS: fs})
//	fs.Arm()     // the next WAL syncs block
//	seq, _ := l.Append(p)
//	<-fs.Entered // the commit of seq is inside fsync
//	...          // a WaitDurable(ctx, seq) now waits until ctx ends
//	fs.Release() // lets it through
//
// Tests call Release in a Cleanup registered after the log's Close, so
// that a failed test does not hang Close.
package gatefs

import (
	"strings"
	"sync"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// FS wraps a vfs.FS: while armed, each Sync of a WAL file (*.log) sends its
// name on Entered and blocks until Release.
type FS struct {
	vfs.FS
	Entered chan string // one send per blocked sync (buffered)

	mu   sync.Mutex    // protects gate
	gate chan struct{} // nil when disarmed; closed by Release
}

// New wraps inner, disarmed.
func New(inner vfs.FS) *FS {
	return &FS{FS: inner, Entered: make(chan string, 1024)}
}

// Arm makes the next WAL syncs block.
func (g *FS) Arm() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.gate = make(chan struct{})
}

// Release lets blocked and later syncs through.
func (g *FS) Release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.gate != nil {
		close(g.gate)
		g.gate = nil
	}
}

func (g *FS) wait(name string) {
	g.mu.Lock()
	gate := g.gate
	g.mu.Unlock()
	if gate == nil {
		return
	}
	g.Entered <- name
	<-gate
}

func (g *FS) Create(name string, cat vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := g.FS.Create(name, cat)
	return g.wrap(name, f, err)
}

func (g *FS) ReuseForWrite(oldname, newname string, cat vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := g.FS.ReuseForWrite(oldname, newname, cat)
	return g.wrap(newname, f, err)
}

func (g *FS) wrap(name string, f vfs.File, err error) (vfs.File, error) {
	if err != nil || !strings.HasSuffix(name, ".log") {
		return f, err
	}
	return &file{File: f, g: g, name: name}, nil
}

type file struct {
	vfs.File
	g    *FS
	name string
}

func (f *file) Sync() error {
	f.g.wait(f.name)
	return f.File.Sync()
}

func (f *file) SyncData() error {
	f.g.wait(f.name)
	return f.File.SyncData()
}

func (f *file) SyncTo(length int64) (bool, error) {
	f.g.wait(f.name)
	return f.File.SyncTo(length)
}
