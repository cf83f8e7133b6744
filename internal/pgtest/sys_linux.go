//go:build linux

package pgtest

import (
	"bytes"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// childCredential returns the identity initdb and postgres run as: nil (our
// own) unless we are root, and then the postgres OS user's, because the
// server refuses to run as root.
func childCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("pgtest: running as root, so postgres must run as the postgres OS user: %w", err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err1 != nil || err2 != nil {
		return nil, fmt.Errorf("pgtest: postgres user has uid %q, gid %q", u.Uid, u.Gid)
	}
	// Groups is empty, so the child also drops root's supplementary groups.
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// childSysProcAttr runs the child as cred and has the kernel send it SIGINT
// (postgres: fast shutdown) when the test process dies. Go sets the
// parent-death signal after switching credentials, which would otherwise
// clear it.
//
// The child gets a process group of its own: a Ctrl-C in the terminal, or a
// SIGTERM sent to our whole group (a CI runner's timeout, `kill -- -PGID`),
// reaches us and not postgres, so the server stays up while we stop in
// order (quotad chaos dumps the ledger after an interrupt) and is stopped
// by us, or by the parent-death signal if we die first.
func childSysProcAttr(cred *syscall.Credential) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGINT, Setpgid: true}
}

func fileOwner(fi os.FileInfo) (uid, gid uint32, ok bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, 0, false
	}
	return st.Uid, st.Gid, true
}

// procStat returns the state and start time (clock ticks after boot) of
// process pid, from /proc/PID/stat. PID and start time together name a
// process: a PID can be reused, the pair cannot.
func procStat(pid int) (state byte, comm string, start uint64, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, "", 0, false
	}
	// "pid (comm) state ppid ..."; comm may hold spaces and parentheses.
	open, closing := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	if open < 0 || closing < open {
		return 0, "", 0, false
	}
	fields := strings.Fields(string(b[closing+1:]))
	// fields[0] is field 3 (state); start time is field 22.
	if len(fields) < 20 || len(fields[0]) != 1 {
		return 0, "", 0, false
	}
	start, err = strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return 0, "", 0, false
	}
	return fields[0][0], string(b[open+1 : closing]), start, true
}

// alive reports whether pid is a process that has not exited (a zombie has).
func alive(pid int) bool {
	state, _, _, ok := procStat(pid)
	return ok && state != 'Z' && state != 'X'
}

// writeOwnerFile records the test process in dir/owner for reapStale.
func writeOwnerFile(dir string) error {
	pid := os.Getpid()
	_, _, start, ok := procStat(pid)
	if !ok {
		return fmt.Errorf("pgtest: read /proc/%d/stat", pid)
	}
	tmp := filepath.Join(dir, "owner.tmp")
	if err := os.WriteFile(tmp, fmt.Appendf(nil, "%d %d\n", pid, start), 0o644); err != nil {
		return fmt.Errorf("pgtest: write owner file: %w", err)
	}
	// Renamed into place, so reapStale never reads half a file.
	return os.Rename(tmp, filepath.Join(dir, "owner"))
}

// ownerGone reports whether dir has an owner file naming a process that no
// longer runs. A directory without one is being created, or not ours.
func ownerGone(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, "owner"))
	if err != nil {
		return false
	}
	var pid int
	var start uint64
	if _, err := fmt.Sscanf(string(b), "%d %d", &pid, &start); err != nil {
		return false
	}
	state, _, st, ok := procStat(pid)
	return !ok || st != start || state == 'Z' || state == 'X'
}

// reapStale removes the server directories in parent whose test process has
// died, stopping their postmaster first. See "Cleanup when a test process
// dies" in the package doc.
func reapStale(parent string, logf func(string, ...any)) {
	entries, err := os.ReadDir(parent)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), dirPrefix) {
			continue
		}
		dir := filepath.Join(parent, e.Name())
		if !ownerGone(dir) {
			continue
		}
		if err := stopStalePostmaster(filepath.Join(dir, "data")); err != nil {
			logf("pgtest: leaving stale %s: %v", dir, err)
			continue
		}
		if err := os.RemoveAll(dir); err != nil {
			logf("pgtest: remove stale %s: %v", dir, err)
			continue
		}
		logf("pgtest: removed stale %s (its test process is gone)", dir)
	}
}

// stopStalePostmaster stops the postmaster of dataDir, if one still runs.
// It signals the PID in postmaster.pid only when that process is a postgres
// whose working directory is dataDir (the postmaster chdirs there), so a
// reused PID is never signalled.
func stopStalePostmaster(dataDir string) error {
	b, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil || pid <= 0 {
		return nil // a torn pid file: postgres was not up
	}
	if !isPostmasterOf(pid, dataDir) {
		return nil
	}
	// Immediate shutdown: nobody will use this data again.
	if err := syscall.Kill(pid, syscall.SIGQUIT); err != nil {
		return fmt.Errorf("signal stale postmaster %d: %w", pid, err)
	}
	if waitGone(pid, 10*time.Second) {
		return nil
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	if waitGone(pid, 5*time.Second) {
		return nil
	}
	return fmt.Errorf("stale postmaster %d did not exit", pid)
}

func isPostmasterOf(pid int, dataDir string) bool {
	state, comm, _, ok := procStat(pid)
	if !ok || state == 'Z' || state == 'X' || comm != "postgres" {
		return false
	}
	cwd, err := os.Readlink("/proc/" + strconv.Itoa(pid) + "/cwd")
	if err != nil {
		return false
	}
	want, err := filepath.EvalSymlinks(dataDir)
	if err != nil {
		return false
	}
	return cwd == want
}

// waitGone polls until pid has exited or the deadline passes. We are not
// the stale postmaster's parent, so we cannot wait(2) for it.
func waitGone(pid int, within time.Duration) bool {
	deadline := time.Now().Add(within)
	backoff := time.Millisecond
	for alive(pid) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, 50*time.Millisecond)
	}
	return true
}
