package cluster

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/quotaring/quotaring/internal/pgtest"
	"github.com/quotaring/quotaring/snapshot"
)

// Ledger down (G8): Postgres is stopped for 20 s while charges go on
// against reservations. Nothing is refused as over quota; charges past what
// the nodes hold reserved get quota-unavailable (not a guess); after
// Postgres returns every acknowledged charge is settled exactly once. A node
// restarted while Postgres is down serves from the snapshot in its data dir.
func TestLedgerDown(t *testing.T) {
	tc := newTestCluster(t, 3)
	const quota = 1 << 30
	accounts := accountIDs("ld-", 50)
	tc.hardAccounts(snapshot.Plan{ID: "ld", MonthlyQuota: quota, Hard: true}, accounts...)
	l := startLoad(tc, accounts, 8, 4)
	l.waitAcked(t, 1000, 60*time.Second)
	srv := pgtest.PackageServer(t)
	ctx := context.Background()
	if err := srv.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	before, _, _ := l.total()
	down := time.Now()
	// A node restarted while the ledger is down comes back ready from its
	// data dir (kill -9 keeps its reservations in its log).
	victim := tc.Nodes[1]
	if err := victim.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := victim.Start(ctx); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	if err := victim.WaitReady(wctx); err != nil {
		t.Fatalf("a node restarted while the ledger is down is not ready: %v", err)
	}
	cancel()
	<-time.After(time.Until(down.Add(20 * time.Second))) // the load goes on: the outage lasts 20 s
	during, refused, _ := l.total()
	if err := srv.Start(ctx); err != nil {
		t.Fatal(err)
	}
	l.waitAcked(t, 500, 60*time.Second)
	l.stop()
	t.Logf("acknowledged %d charges while the ledger was down for 20 s (%d in all); refused as over quota: %d", during-before, during, refused)
	if during-before == 0 {
		t.Fatal("G8: no charge was acknowledged while the ledger was down")
	}
	if refused > 0 {
		t.Fatalf("%d charges were refused (%v), with quotas of 2^30 and no rate limit", refused, l.reasons)
	}
	tc.settleAll(60 * time.Second)
	l.check(t, quota)
}

// A node killed with SIGKILL between the ledger's COMMIT and marking the
// batch settled in its log: after restart nothing is counted twice.
func TestKillBetweenCommitAndLocalMark(t *testing.T) {
	// A settle every 2 s keeps most of the charges unsettled until the
	// failpoint is armed.
	tc := newTestCluster(t, 1, "--settle-interval", "2s")
	tc.hardAccounts(snapshot.Plan{ID: "c", MonthlyQuota: 1000, Hard: true}, "crashy")
	ctx := context.Background()
	n := tc.Nodes[0]
	for i := 0; i < 50; i++ {
		if o, _, err := tc.charge(ctx, n, "crashy", fmt.Sprint("e", i), 1); o != acked {
			t.Fatalf("charge %d: %v", i, err)
		}
	}
	// A settle may have put some of them in the ledger already, or be on
	// its way with some of them as the failpoint is armed (a loaded
	// machine): the batch the failpoint kills after carries what it carries.
	before := tc.used("crashy")
	if code, _, err := n.AdminPost(ctx, "/test/crash-after-commit"); err != nil || code != 200 {
		t.Fatalf("arm the failpoint: %d %v", code, err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := n.Wait(wctx); err == nil {
		t.Fatal("the node exited cleanly; the failpoint should have killed it")
	}
	if !strings.Contains(n.LogTail(5), "SIGKILL between the ledger commit and the local mark") {
		t.Fatalf("the node died elsewhere:\n%s", n.LogTail(10))
	}
	if u := tc.used("crashy"); u <= before || u > 50 {
		t.Fatalf("before the restart the ledger holds %d units, %d before the failpoint was armed: the batch it killed after committed no charge", u, before)
	}
	if err := n.Start(ctx); err != nil {
		t.Fatal(err)
	}
	tc.converge(30 * time.Second)
	for i := 50; i < 60; i++ {
		if o, _, err := tc.charge(ctx, n, "crashy", fmt.Sprint("e", i), 1); o != acked {
			t.Fatalf("charge %d after restart: %v", i, err)
		}
	}
	tc.settleAll(30 * time.Second)
	if u := tc.used("crashy"); u != 60 {
		t.Fatalf("ledger used %d after the restart and 10 more charges, want 60 (nothing counted twice)", u)
	}
}

// quotad reconcile finds a difference injected on purpose and exits
// non-zero; on a clean ledger it exits zero.
func TestReconcileCommand(t *testing.T) {
	tc := newTestCluster(t, 2)
	tc.hardAccounts(snapshot.Plan{ID: "r", MonthlyQuota: 100, Hard: true}, "rec-1", "rec-2")
	ctx := context.Background()
	for i := 0; i < 20; i++ {
		if o, _, err := tc.charge(ctx, tc.Nodes[i%2], fmt.Sprint("rec-", 1+i%2), "", 1); o != acked {
			t.Fatal(err)
		}
	}
	tc.settleAll(30 * time.Second)
	out, code := runQuotad(t, "reconcile", "--ledger", tc.dsn)
	if code != 0 {
		t.Fatalf("reconcile on a clean ledger exited %d:\n%s", code, out)
	}
	conn, err := pgx.Connect(ctx, tc.dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `UPDATE grants SET used = used + 3 WHERE account_id = 'rec-2'`); err != nil {
		t.Fatal(err)
	}
	out, code = runQuotad(t, "reconcile", "--ledger", tc.dsn)
	if code != 3 || !strings.Contains(out, "rec-2") || strings.Contains(out, "rec-1 ") {
		t.Fatalf("reconcile after injecting +3 on rec-2 exited %d:\n%s", code, out)
	}
}

// Bad input: a DSN that does not connect, a ledger on a newer schema than
// the binary: each gives a clear error that says what to do.
func TestLedgerBadInput(t *testing.T) {
	out, code := runQuotad(t, "migrate", "--ledger", "postgres://nobody@127.0.0.1:1/none?connect_timeout=2")
	if code == 0 || !strings.Contains(out, "127.0.0.1:1") {
		t.Fatalf("migrate against nothing exited %d:\n%s", code, out)
	}
	dsn := pgtest.NewDB(t)
	if out, code := runQuotad(t, "migrate", "--ledger", dsn); code != 0 {
		t.Fatalf("migrate: %d\n%s", code, out)
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `INSERT INTO schema_migrations (version, applied_at) VALUES (999, now())`); err != nil {
		t.Fatal(err)
	}
	out, code = runQuotad(t, "migrate", "--ledger", dsn)
	if code == 0 || !strings.Contains(out, "999") || !strings.Contains(strings.ToLower(out), "newer") {
		t.Fatalf("migrate on a newer schema exited %d:\n%s", code, out)
	}
	out, code = runQuotad(t, "serve", "--ledger", dsn, "--data-dir", t.TempDir(), "--node-id", "x",
		"--rpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--gossip-addr", "127.0.0.1:0")
	if code == 0 || !strings.Contains(out, "999") {
		t.Fatalf("serve on a newer schema exited %d:\n%s", code, out)
	}
}

// runQuotad runs the binary and returns its combined output and exit code.
func runQuotad(t *testing.T, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	var buf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		return buf.String(), ee.ExitCode()
	}
	if err != nil {
		t.Fatalf("run quotad %v: %v", args, err)
	}
	return buf.String(), 0
}

// A second process started as a running node's id while the ledger is
// down cannot check at start; it checks when it first reaches the ledger,
// watching a whole lease for the id's heartbeats, finds the running one's
// and stops (exit 1), while the running one goes on.
func TestTwinStartedWhileTheLedgerIsDownStops(t *testing.T) {
	tc := newTestCluster(t, 3)
	running := tc.Nodes[2]
	twin, err := tc.newNode(len(tc.Nodes)) // an address, ports and a data dir of its own
	if err != nil {
		t.Fatal(err)
	}
	twin.ID = running.ID
	twin.args[slices.Index(twin.args, "--node-id")+1] = running.ID
	srv := pgtest.PackageServer(t)
	ctx := context.Background()
	if err := srv.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	// Longer than a lease: the id's last heartbeat in the ledger is old
	// when the twin reaches it.
	down := time.Now()
	if err := twin.Start(ctx); err != nil {
		t.Fatal(err)
	}
	<-time.After(time.Until(down.Add(8 * time.Second)))
	if err := srv.Start(ctx); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	code, _ := twin.Wait(wctx)
	if log := twin.LogTail(60); code != 1 || !strings.Contains(log, "found when the ledger was first reached") {
		t.Fatalf("the twin: exit %d; want 1 and the reason in its log:\n%s", code, log)
	}
	if !running.Running() {
		t.Fatalf("the running node stopped:\n%s", running.LogTail(30))
	}
	tc.converge(60 * time.Second)
}
