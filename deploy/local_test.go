package deploy

// deploy/local/cluster.sh, run for real: a throwaway Postgres and quotad
// nodes on loopback.

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/logbuf"
)

const clusterScript = "local/cluster.sh"

func TestClusterScriptSyntax(t *testing.T) {
	if out, err := exec.Command("bash", "-n", clusterScript).CombinedOutput(); err != nil {
		t.Fatalf("bash -n %s: %v\n%s", clusterScript, err, out)
	}
	run := func(args ...string) (string, int) {
		cmd := exec.Command("bash", append([]string{clusterScript}, args...)...)
		cmd.Env = cleanEnv()
		out, err := cmd.CombinedOutput()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return string(out), code
	}
	if out, code := run("--help"); code != 0 || !strings.Contains(out, "--nodes N") {
		t.Errorf("--help: exit %d\n%s", code, out)
	}
	for _, bad := range [][]string{{"--bogus"}, {"--nodes", "0"}, {"--nodes", "x"}, {"restart"}, {"stop"}} {
		if out, code := run(bad...); code == 0 || !strings.Contains(out, "error:") {
			t.Errorf("%q: exit %d, want a clear error\n%s", bad, code, out)
		}
	}
	// stop refuses a directory the script did not make.
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "pids"), []byte("q1 1\n"), 0o644)
	if out, code := run("stop", "--dir", dir); code == 0 || !strings.Contains(out, "not made by") {
		t.Errorf("stop on a foreign dir: exit %d\n%s", code, out)
	}
	if _, err := os.Stat(filepath.Join(dir, "pids")); err != nil {
		t.Errorf("stop on a foreign dir touched it: %v", err)
	}
}

// requirePG skips (or, with QUOTARING_REQUIRE_PG=1, fails) a test that needs
// the Postgres server binaries, looked up as cluster.sh does.
func requirePG(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("initdb"); err == nil {
		return
	}
	if m, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb"); len(m) > 0 {
		return
	}
	msg := "SKIP: Postgres binaries not found (initdb on PATH or in /usr/lib/postgresql/*/bin); set QUOTARING_REQUIRE_PG=1 to make this a failure"
	if os.Getenv("QUOTARING_REQUIRE_PG") == "1" {
		t.Fatal(strings.Replace(msg, "SKIP: ", "", 1))
	}
	fmt.Fprintf(os.Stderr, "deploy: %s: %s\n", t.Name(), msg)
	t.Skip(msg)
}

// scriptDir makes the directory for a cluster.sh run: under the system temp
// dir (the postgres user must be able to reach it; a t.TempDir's parent is
// 0700), removed at the end.
func scriptDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "quotaring-deploytest-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// If the test failed half way, stop whatever the script left.
		if _, err := os.Stat(filepath.Join(dir, ".quotaring-local-cluster")); err == nil {
			cmd := exec.Command("bash", clusterScript, "stop", "--dir", dir)
			cmd.Env = cleanEnv()
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Logf("cleanup: cluster.sh stop: %v\n%s", err, out)
			}
		}
		os.RemoveAll(dir)
	})
	return dir
}

// clusterEnv reads DIR/cluster.env.
func clusterEnv(t *testing.T, dir string) map[string]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "cluster.env"))
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		k, v, _ := strings.Cut(l, "=")
		env[k] = strings.Trim(v, "'")
	}
	return env
}

// startedPIDs reads DIR/pids: name -> PID of every process the script started.
func startedPIDs(t *testing.T, dir string) map[string]int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "pids"))
	if err != nil {
		t.Fatal(err)
	}
	pids := map[string]int{}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(l)
		if len(f) != 2 {
			t.Fatalf("pids: bad line %q", l)
		}
		n, err := strconv.Atoi(f[1])
		if err != nil {
			t.Fatalf("pids: bad line %q", l)
		}
		pids[f[0]] = n
	}
	return pids
}

// running reports whether pid is a live process (a zombie waiting for init
// to reap it is not).
func running(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

func checkReady(t *testing.T, env map[string]string, nodes int) {
	t.Helper()
	admins := strings.Split(env["QUOTARING_ADMIN_ADDRS"], ",")
	if len(admins) != nodes {
		t.Fatalf("cluster.env lists admin addresses %q: want %d", env["QUOTARING_ADMIN_ADDRS"], nodes)
	}
	client := &http.Client{Timeout: 3 * time.Second}
	for _, a := range admins {
		resp, err := client.Get("http://" + a + "/readyz")
		if err != nil {
			t.Errorf("GET %s/readyz: %v", a, err)
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("GET %s/readyz: %d %s", a, resp.StatusCode, body)
		}
	}
}

func checkAllGone(t *testing.T, pids map[string]int, dir string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for name, pid := range pids {
		for running(pid) {
			if time.Now().After(deadline) {
				t.Errorf("%s (pid %d), started by cluster.sh, still runs after the cluster stopped", name, pid)
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) > 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("cluster.sh left %v in %s", names, dir)
	}
}

// TestLocalCluster runs `cluster.sh --nodes 3` in the foreground as an
// operator would (it builds quotad itself), waits for it to say the cluster
// is ready, checks every node's /readyz, then stops it with SIGINT (Ctrl-C)
// and checks that nothing it started still runs and its dir is emptied.
func TestLocalCluster(t *testing.T) {
	requirePG(t)
	if testing.Short() {
		t.Skip("SKIP in -short: starts Postgres and three nodes")
	}
	const nodes = 3
	dir := scriptDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", clusterScript, "--nodes", strconv.Itoa(nodes), "--dir", dir)
	cmd.Env = cleanEnv()
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	var out logbuf.Buffer
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(pr)
		signalled := false
		for sc.Scan() {
			fmt.Fprintln(&out, sc.Text())
			if !signalled && sc.Text() == fmt.Sprintf("cluster ready: %d node(s)", nodes) {
				close(ready)
				signalled = true
			}
		}
	}()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { err := cmd.Wait(); pw.Close(); exited <- err }()
	defer func() {
		if t.Failed() {
			t.Logf("cluster.sh output:\n%s", out.String())
		}
	}()

	select {
	case <-ready:
	case err := <-exited:
		t.Fatalf("cluster.sh exited before the cluster was ready: %v", err)
	case <-time.After(5 * time.Minute):
		cmd.Process.Signal(syscall.SIGTERM)
		<-exited
		t.Fatalf("cluster.sh did not print ready within 5 minutes")
	}
	pids := startedPIDs(t, dir)
	if len(pids) != nodes+1 {
		t.Errorf("pids lists %v: want postgres and %d nodes", pids, nodes)
	}
	for name, pid := range pids {
		if !running(pid) {
			t.Errorf("%s (pid %d) is not running", name, pid)
		}
	}
	env := clusterEnv(t, dir)
	checkReady(t, env, nodes)

	// A benchmark runs against it for a few seconds (issue 7, Show 4).
	bench := exec.CommandContext(ctx, env["QUOTARING_QUOTAD"], "bench", "cluster", "--nodes", env["QUOTARING_RPC_ADDRS"],
		"--ledger", env["QUOTARING_LEDGER"], "--setup", "--accounts", "200", "--concurrency", "8", "--duration", "3s")
	bench.Env = cleanEnv()
	benchOut, err := bench.CombinedOutput()
	if err != nil {
		t.Fatalf("quotad bench cluster against the local cluster: %v\n%s", err, benchOut)
	}
	if !strings.Contains(string(benchOut), "charges/s") {
		t.Fatalf("quotad bench cluster printed no result:\n%s", benchOut)
	}
	// NB: errors are reported, not failed on: on a CI machine running other
	// packages' clusters at the same time, an fsync can stall past the call
	// timeout; the point here is that the script's cluster takes a bench.
	t.Logf("bench against the local cluster:\n%s", benchOut)

	// Ctrl-C.
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 130 {
			t.Errorf("cluster.sh after SIGINT: %v, want exit status 130", err)
		}
	case <-time.After(90 * time.Second):
		t.Fatalf("cluster.sh still running 90s after SIGINT")
	}
	if !strings.Contains(out.String(), "stopping postgres") {
		t.Errorf("cluster.sh did not stop postgres")
	}
	checkAllGone(t, pids, dir)
}

// TestLocalClusterDetach runs `cluster.sh --detach` (it returns once the
// nodes are ready) and then `cluster.sh stop --dir`.
func TestLocalClusterDetach(t *testing.T) {
	requirePG(t)
	if testing.Short() {
		t.Skip("SKIP in -short: starts Postgres and two nodes")
	}
	const nodes = 2
	// A binary not named quotad: the script must recognise its nodes by
	// their command line, not by the program's name.
	b, err := os.ReadFile(buildQuotad(t))
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "qd")
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	dir := scriptDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", clusterScript, "--detach", "--nodes", strconv.Itoa(nodes), "--dir", dir, "--quotad", bin)
	cmd.Env = cleanEnv()
	// The nodes it leaves running hold no pipe of ours (their output goes to
	// their logs), so this returns when the script does.
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("cluster.sh --detach: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), fmt.Sprintf("cluster ready: %d node(s)", nodes)) {
		t.Fatalf("cluster.sh --detach did not say ready:\n%s", out)
	}
	pids := startedPIDs(t, dir)
	for name, pid := range pids {
		if !running(pid) {
			t.Errorf("%s (pid %d) is not running after --detach returned", name, pid)
		}
	}
	checkReady(t, clusterEnv(t, dir), nodes)

	stop := exec.CommandContext(ctx, "bash", clusterScript, "stop", "--dir", dir)
	stop.Env = cleanEnv()
	if out, err := stop.CombinedOutput(); err != nil {
		t.Fatalf("cluster.sh stop: %v\n%s", err, out)
	}
	checkAllGone(t, pids, dir)
}
