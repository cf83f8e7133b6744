package pgtest

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
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

// TestPostgresHasItsOwnProcessGroup: a signal to our process group (Ctrl-C
// in a terminal, a CI runner's group SIGTERM) must not reach postgres, or
// it shuts down under a caller that is still stopping in order.
func TestPostgresHasItsOwnProcessGroup(t *testing.T) {
	RequireBinaries(t)
	s, err := Start(t.Context(), Options{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	s.mu.Lock()
	pid := s.cmd.Process.Pid
	s.mu.Unlock()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// "pid (comm) state ppid pgrp ..."
	fields := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	pgrp, err := strconv.Atoi(fields[2])
	if err != nil {
		t.Fatalf("parse /proc/%d/stat %q: %v", pid, b, err)
	}
	if pgrp == syscall.Getpgrp() {
		t.Fatalf("postgres (pid %d) is in our process group %d: a Ctrl-C meant for us stops it too", pid, pgrp)
	}
	if pgrp != pid {
		t.Errorf("postgres (pid %d) is in process group %d, want its own", pid, pgrp)
	}
}
