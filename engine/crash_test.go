package engine

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
)

const crashChildEnv = "QUOTARING_ENGINE_CRASH_CHILD"

const crashWorkers = 64

// TestCrashChild is the child of TestCrashRecovery: it charges from many
// goroutines and prints each acknowledged event id, until it is killed.
func TestCrashChild(t *testing.T) {
	dir := os.Getenv(crashChildEnv)
	if dir == "" {
		t.Skip("runs only as the child of TestCrashRecovery")
	}
	e := openEngine(t, dir, NewSystemClock(), testSnapshot(t, map[string]int64{"a": 1 << 40, "b": 1 << 40}))
	out := bufio.NewWriter(os.Stdout)
	var mu sync.Mutex // protects out
	var wg sync.WaitGroup
	for w := 0; w < crashWorkers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 1_000_000; i++ {
				id := fmt.Sprintf("w%d-%d", w, i)
				res, err := e.Charge(context.Background(), []string{"a", "b"}[w%2], shard.Charge{EventID: id, ClientID: true, Units: 1})
				if err != nil || res.Reason != shard.OK {
					fmt.Fprintln(os.Stderr, "charge failed:", res.Reason, err)
					os.Exit(3)
				}
				mu.Lock()
				fmt.Fprintln(out, "ack", id)
				out.Flush()
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
}

// TestCrashRecovery kills a charging child with SIGKILL at a seeded random
// moment, then requires the recovered state to hold every acknowledged
// charge, and nothing unacknowledged beyond what was in flight. Then it tears
// the log's tail and requires the node to open and stay consistent.
func TestCrashRecovery(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns processes")
	}
	for _, seed := range []uint64{1, 2, 3, 4} {
		t.Run(fmt.Sprint("seed=", seed), func(t *testing.T) {
			dir := t.TempDir()
			rng := rand.New(rand.NewPCG(seed, 99))
			killAfter := 50 + rng.IntN(3000)
			acked := runAndKill(t, dir, killAfter)
			t.Logf("seed %d: killed after %d acks, %d acked in all", seed, killAfter, len(acked))

			e := openEngine(t, dir, NewSystemClock(), nil)
			inLog := map[string]bool{}
			var rec shard.Record
			l := e.Log()
			if err := l.Scan(l.SettledSeq(), l.DurableSeq(), func(_ uint64, p []byte) error {
				if err := rec.Decode(p); err != nil {
					return err
				}
				inLog[rec.EventID] = true
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			for id := range acked {
				if !inLog[id] {
					t.Fatalf("acknowledged charge %s is not in the recovered log", id)
				}
			}
			if extra := len(inLog) - len(acked); extra < 0 || extra > crashWorkers {
				t.Fatalf("%d charges in the log were never acknowledged; at most %d were in flight", extra, crashWorkers)
			}
			ua, _, _ := e.Usage("a")
			ub, _, _ := e.Usage("b")
			if int(ua.Used+ub.Used) != len(inLog) {
				t.Fatalf("counters %d+%d, log %d records", ua.Used, ub.Used, len(inLog))
			}
			ids := sortedKeys(acked)
			for _, id := range ids[:min(len(ids), 200)] {
				acct := []string{"a", "b"}[workerOf(id)%2]
				if res, err := e.Charge(context.Background(), acct, shard.Charge{EventID: id, ClientID: true, Units: 1}); err != nil || res.Reason != shard.Replayed {
					t.Fatalf("retry of acknowledged %s after the crash: %v %v, want replayed", id, res.Reason, err)
				}
			}
			e.Close()
			e.Log().Close()
			tearNewestLog(t, dir)
			e2 := openEngine(t, dir, NewSystemClock(), nil)
			n, units := countRecords(t, e2.Log(), shard.RecCharge)
			ua, _, _ = e2.Usage("a")
			ub, _, _ = e2.Usage("b")
			if ua.Used+ub.Used != units || n == 0 {
				t.Fatalf("after a torn tail: counters %d, %d records of %d units", ua.Used+ub.Used, n, units)
			}
		})
	}
}

func runAndKill(t *testing.T, dir string, killAfter int) map[string]bool {
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.v")
	cmd.Env = append(os.Environ(), crashChildEnv+"="+dir)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	acked := map[string]bool{}
	sc := bufio.NewScanner(out)
	killed := false
	deadline := time.Now().Add(2 * time.Minute)
	for sc.Scan() {
		if id, ok := strings.CutPrefix(sc.Text(), "ack "); ok {
			acked[id] = true
		}
		if !killed && (len(acked) >= killAfter || time.Now().After(deadline)) {
			cmd.Process.Signal(syscall.SIGKILL)
			killed = true
		}
	}
	cmd.Wait()
	if !killed {
		t.Fatalf("the child ended before it was killed, after %d acks", len(acked))
	}
	return acked
}

// tearNewestLog cuts a few bytes off the newest Pebble WAL file, as a crash in
// the middle of a write would.
func tearNewestLog(t *testing.T, dir string) {
	logs, _ := filepath.Glob(filepath.Join(dir, "*.log"))
	sort.Strings(logs)
	if len(logs) == 0 {
		t.Fatalf("no pebble WAL file in %s", dir)
	}
	newest := logs[len(logs)-1]
	fi, err := os.Stat(newest)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() > 7 {
		if err := os.Truncate(newest, fi.Size()-7); err != nil {
			t.Fatal(err)
		}
	}
}

func workerOf(id string) int {
	var w, i int
	fmt.Sscanf(id, "w%d-%d", &w, &i)
	return w
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
