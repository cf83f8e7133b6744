package pgtest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// TestReapStale plays a test process that died without Close: its server
// directory says its owner is gone, and the next Start in the same parent
// stops that postmaster and removes the directory, leaving live owners'
// directories alone.
func TestReapStale(t *testing.T) {
	RequireBinaries(t)
	parent, err := os.MkdirTemp("", "pgtest-reap-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(parent)
	if err := os.Chmod(parent, 0o755); err != nil { // the postgres user must enter it
		t.Fatal(err)
	}

	s, err := Start(t.Context(), Options{Dir: parent, Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	s.mu.Lock()
	exited := s.exited
	s.mu.Unlock()

	// A process that has exited stands for the dead test process.
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	owner := fmt.Appendf(nil, "%d 1\n", dead.Process.Pid)
	if err := os.WriteFile(filepath.Join(s.Dir(), "owner"), owner, 0o644); err != nil {
		t.Fatal(err)
	}
	// A live owner's directory (ours) and one without an owner file.
	live, err := os.MkdirTemp(parent, dirPrefix)
	if err != nil {
		t.Fatal(err)
	}
	if err := writeOwnerFile(live); err != nil {
		t.Fatal(err)
	}
	unowned, err := os.MkdirTemp(parent, dirPrefix)
	if err != nil {
		t.Fatal(err)
	}

	reapStale(parent, t.Logf)

	select {
	case <-exited:
	case <-time.After(30 * time.Second):
		t.Fatal("the stale postmaster is still running")
	}
	if _, err := os.Stat(s.Dir()); !os.IsNotExist(err) {
		t.Errorf("stale dir %s not removed: stat err = %v", s.Dir(), err)
	}
	for _, d := range []string{live, unowned} {
		if _, err := os.Stat(d); err != nil {
			t.Errorf("reapStale removed %s, which is not stale: %v", d, err)
		}
	}
}
