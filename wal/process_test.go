package wal

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/quotaring/quotaring/internal/dirsnap"
)

// childDirEnv switches the test binary into the child of
// TestProcessKillKeepsAcked: it appends to the log in that dir until killed.
const childDirEnv = "WAL_TEST_CHILD_DIR"

// childAppenders is the number of goroutines in the child. Each waits for
// its record before appending the next, so one commit holds at most this
// many records.
const childAppenders = 8

func TestMain(m *testing.M) {
	if dir := os.Getenv(childDirEnv); dir != "" {
		os.Exit(runChild(dir))
	}
	os.Exit(m.Run())
}

// runChild appends from childAppenders goroutines and prints each seq to
// stdout once WaitDurable returned nil for it. It runs until killed.
func runChild(dir string) int {
	l, err := Open(Options{Dir: dir, NodeID: "child"})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	var mu sync.Mutex // serializes the lines on stdout
	errs := make(chan error, childAppenders)
	for w := range childAppenders {
		go func() {
			for i := 0; ; i++ {
				seq, err := l.Append(fmt.Appendf(nil, "w%d-%d", w, i))
				if err == nil {
					err = l.WaitDurable(context.Background(), seq)
				}
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				fmt.Fprintln(os.Stdout, seq) // os.Stdout is unbuffered
				mu.Unlock()
			}
		}()
	}
	fmt.Fprintln(os.Stderr, <-errs)
	return 3
}

// TestProcessKillKeepsAcked runs this test binary as a child that appends
// and prints each durable seq, kills it with SIGKILL after a seeded number
// of lines, and requires every printed seq after reopening the dir. It then
// cuts a few bytes off the newest Pebble WAL file of a copy of the dir: that
// cuts the final commit, and Open must refuse rather than lose a printed
// record (see checkTornDir).
func TestProcessKillKeepsAcked(t *testing.T) {
	if testing.Short() {
		t.Skip("starts child processes")
	}
	for _, seed := range []uint64{1, 2, 3, 4} {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 0))
			dir := t.TempDir()
			printed := runAndKill(t, dir, 1+rng.IntN(3000))
			torn := t.TempDir()
			if err := os.CopyFS(torn, os.DirFS(dir)); err != nil {
				t.Fatal(err)
			}
			checkKilledDir(t, dir, printed)
			checkTornDir(t, torn, printed)
		})
	}
}

// runAndKill starts the child on dir, kills it once it printed killAfter
// lines, and returns every seq it printed.
func runAndKill(t *testing.T, dir string, killAfter int) []uint64 {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childDirEnv+"="+dir)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var printed []uint64
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		seq, err := strconv.ParseUint(sc.Text(), 10, 64)
		if err != nil {
			t.Fatalf("child printed %q", sc.Text())
		}
		printed = append(printed, seq)
		if len(printed) == killAfter {
			_ = cmd.Process.Kill() // SIGKILL; lines already in the pipe are still read
		}
	}
	err = cmd.Wait()
	if len(printed) < killAfter {
		t.Fatalf("child exited by itself after %d lines: %v\n%s", len(printed), err, stderr.String())
	}
	t.Logf("killed after %d lines, %d read in all", killAfter, len(printed))
	return printed
}

// checkKilledDir requires every printed seq, a gap-free log, and a sequence
// that resumes above them.
func checkKilledDir(t *testing.T, dir string, printed []uint64) {
	l := mustOpen(t, Options{Dir: dir, NodeID: "child"})
	recs := readAll(t, l)
	for _, seq := range printed {
		if _, ok := recs[seq]; !ok {
			t.Fatalf("seq %d was printed as durable but is missing after the kill", seq)
		}
	}
	requireContiguous(t, recs, 0, l.LastSeq())
	if seq := appendDurable(t, l, []byte("after")); seq != l.LastSeq() || seq <= slices.Max(printed) {
		t.Fatalf("sequence resumed at %d, printed up to %d", seq, slices.Max(printed))
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
}

// checkTornDir truncates the newest WAL file of dir, which cuts the final
// commit. That commit was durable, and its records may have been printed
// (acknowledged): then this is lost data, not a torn tail, and Open must
// refuse, naming the WAL file. Open may succeed only when no printed record
// is lost (the kill came before the durable mark passed the final commit),
// and then with at most that commit gone.
func checkTornDir(t *testing.T, dir string, printed []uint64) {
	name := newestWALFile(t, dir)
	fi, err := os.Stat(name)
	if err != nil || fi.Size() < 8 {
		t.Fatalf("newest WAL %s: %v, %v", name, fi, err)
	}
	if err := os.Truncate(name, fi.Size()-3); err != nil {
		t.Fatal(err)
	}
	l, err := Open(Options{Dir: dir, NodeID: "child"})
	if err != nil {
		if !IsCorrupt(err) || !strings.Contains(err.Error(), filepath.Base(name)) {
			t.Fatalf("Open after truncating %s = %v, want a corruption error naming it", name, err)
		}
		t.Logf("truncated %s (%d bytes): refused: %v", filepath.Base(name), fi.Size(), err)
		return
	}
	defer l.Close()
	recs := readAll(t, l)
	requireContiguous(t, recs, 0, l.LastSeq())
	var lost []uint64
	for _, seq := range printed {
		if _, ok := recs[seq]; !ok {
			lost = append(lost, seq)
		}
	}
	if len(lost) > 0 {
		t.Fatalf("truncating %s lost printed (acknowledged) records %v, and Open succeeded", name, lost)
	}
	t.Logf("truncated %s (%d bytes): opened with %d records, no printed record lost", filepath.Base(name), fi.Size(), len(recs))
}

// newestWALFile returns the Pebble WAL file with the highest number in dir.
func newestWALFile(t *testing.T, dir string) string {
	logs, err := filepath.Glob(filepath.Join(dir, "*.log"))
	if err != nil || len(logs) == 0 {
		t.Fatalf("no WAL file in %s: %v", dir, err)
	}
	slices.SortFunc(logs, strings.Compare)
	return logs[len(logs)-1]
}

// TestLockedDirNamesTheOtherProcess starts a child that holds a log open,
// then opens the same dir: the error must say that another process holds
// the dir's lock and what to do, not only "resource temporarily
// unavailable".
func TestLockedDirNamesTheOtherProcess(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a child process")
	}
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childDirEnv+"="+dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	if !bufio.NewScanner(out).Scan() { // the child has the log open once it printed a seq
		t.Fatal("the child printed nothing")
	}
	l, err := Open(Options{Dir: dir, NodeID: "child"})
	if err == nil {
		_ = l.Close()
		t.Fatal("Open succeeded on a dir another process holds")
	}
	for _, want := range []string{"is in use: another process holds its lock", "fuser -v " + dir, "stop that process"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	t.Log(err)
}

// TestDeletedLOCKStillExcludes: Pebble's LOCK file is created anew when
// missing, so with it deleted a second Open locked a new one and wrote a
// MANIFEST, sstables and the durable mark into a dir a node still served
// from. The lock on the directory itself refuses it before any write, and
// is released by Close.
func TestDeletedLOCKStillExcludes(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	l, err := Open(Options{Dir: dir, NodeID: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, "LOCK")); err != nil {
		t.Fatal(err)
	}
	before := dirsnap.Take(t, dir)
	if l2, err := Open(Options{Dir: dir, NodeID: "n1"}); err == nil {
		_ = l2.Close()
		t.Fatal("a second Open of a dir in use, its LOCK deleted, succeeded")
	} else if !strings.Contains(err.Error(), "is in use") || !strings.Contains(err.Error(), "fuser -v "+dir) {
		t.Errorf("second Open: %v, want the dir named in use", err)
	}
	before.Unchanged(t, dir, "the refused Open")
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l, err = Open(Options{Dir: dir, NodeID: "n1"})
	if err != nil {
		t.Fatalf("Open after Close: %v, want the lock released", err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
}
