package cluster

import (
	"bufio"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/pgtest"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/snapshot"
)

// deploy/metrics.txt, which the dashboard and the alert rules are checked
// against, is exactly the set of quotaring_ metrics a running node exports
// (with a quota alert webhook, whose metrics exist only then).
func TestMetricsMatchTheDeployList(t *testing.T) {
	tc := newTestCluster(t, 1, "--alert-webhook", "http://127.0.0.1:9/hooks/quota", "--alert-secret", "metrics-test-secret")
	_, file, _, _ := runtime.Caller(0)
	f, err := os.Open(filepath.Join(filepath.Dir(file), "..", "..", "deploy", "metrics.txt"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_, body, err := tc.Nodes[0].AdminGet(context.Background(), "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	exported := map[string]bool{}
	for _, line := range strings.Split(body, "\n") {
		if name, ok := strings.CutPrefix(line, "# TYPE "); ok {
			exported[strings.Fields(name)[0]] = true
		}
	}
	sc := bufio.NewScanner(f)
	listed := map[string]bool{}
	for sc.Scan() {
		name := strings.TrimSpace(sc.Text())
		if name == "" || strings.HasPrefix(name, "#") {
			continue
		}
		listed[name] = true
		if !exported[name] {
			t.Errorf("deploy/metrics.txt lists %s, which the node does not export", name)
		}
	}
	if len(listed) < 20 {
		t.Fatalf("read only %d names from deploy/metrics.txt", len(listed))
	}
	// And the other way: the list is the node's whole set, so an operator
	// reading it (or a dashboard built from it) misses nothing.
	for name := range exported {
		if strings.HasPrefix(name, "quotaring_") && !listed[name] {
			t.Errorf("the node exports %s, which deploy/metrics.txt does not list", name)
		}
	}
	// Every label value an alert rule selects is one the node exports (the
	// node creates its label combinations at start): a rule on
	// reason="unavailble" would never fire.
	rules, err := os.ReadFile(filepath.Join(filepath.Dir(file), "..", "..", "deploy", "prometheus", "alerts.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	matchers := regexp.MustCompile(`(quotaring_[a-z0-9_]+)\{([^}]*)\}`).FindAllStringSubmatch(string(rules), -1)
	if len(matchers) == 0 {
		t.Fatal("found no quotaring_ selector with labels in deploy/prometheus/alerts.yaml")
	}
	for _, m := range matchers {
		for _, pair := range strings.Split(m[2], ",") {
			k, v, ok := strings.Cut(strings.TrimSpace(pair), "=")
			if !ok || strings.HasPrefix(v, "~") || strings.HasSuffix(k, "!") {
				t.Errorf("alerts.yaml: %s{%s}: only exact matchers are checked; make this one k=\"v\" or extend the test", m[1], m[2])
				continue
			}
			found := false
			for _, line := range strings.Split(body, "\n") {
				if strings.HasPrefix(line, m[1]+"{") && strings.Contains(line, k+"="+v) {
					found = true
					break
				}
			}
			if !found {
				t.Errorf("alerts.yaml selects %s{%s=%s}, which no series of the node has", m[1], k, v)
			}
		}
	}
}

// SIGTERM under load: in-flight requests finish, everything is settled,
// reservations are handed back, and the process exits 0 within its budget.
// With the ledger down it exits non-zero and its records are still there at
// the next start.
func TestSIGTERMUnderLoad(t *testing.T) {
	tc := newTestCluster(t, 3)
	const quota = 1000
	accounts := accountIDs("term-", 100)
	tc.hardAccounts(snapshot.Plan{ID: "term", MonthlyQuota: quota, Hard: true}, accounts...)
	l := startLoad(tc, accounts, 12, 5)
	l.waitAcked(t, 1000, 60*time.Second)
	ctx := context.Background()
	victim := tc.Nodes[0]
	t0 := time.Now()
	code, err := victim.Terminate(ctx)
	took := time.Since(t0)
	// The budget: --drain-timeout 10s + --settle-timeout 20s + the 10s margin of quotad serve.
	if code != 0 || took > 40*time.Second {
		t.Fatalf("SIGTERM under load: exit %d after %s (%v)\n%s", code, took, err, victim.LogTail(20))
	}
	t.Logf("drained, settled and exited 0 in %s", took.Round(time.Millisecond))
	log := victim.LogTail(400)
	if !strings.Contains(log, "final settle done") {
		t.Fatalf("no final settle in the log:\n%s", victim.LogTail(20))
	}
	held, err := tc.ledger.Reservations(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range held {
		if r.Node == victim.ID {
			t.Fatalf("the stopped node still holds %d units of %s/%s", r.Units, r.Account, r.Grant)
		}
	}
	l.waitAcked(t, 500, 60*time.Second)
	l.stop()
	tc.settleAll(30 * time.Second)
	l.check(t, quota)
}

func TestSIGTERMWithTheLedgerDown(t *testing.T) {
	tc := newTestCluster(t, 1)
	tc.hardAccounts(snapshot.Plan{ID: "down", MonthlyQuota: 1 << 30, Hard: true}, "kept")
	ctx := context.Background()
	n := tc.Nodes[0]
	for i := 0; i < 20; i++ {
		if o, _, err := tc.charge(ctx, n, "kept", "", 1); o != acked {
			t.Fatal(err)
		}
	}
	tc.settleAll(30 * time.Second)
	srv := pgtest.PackageServer(t)
	if err := srv.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	acknowledged := 0
	for i := 0; i < 200 && acknowledged < 10; i++ { // what the node holds reserved still charges
		if o, _, _ := tc.charge(ctx, n, "kept", "", 1); o == acked {
			acknowledged++
		}
	}
	if acknowledged == 0 {
		t.Fatal("no charge acknowledged against the reservation with the ledger down")
	}
	code, _ := n.Terminate(ctx)
	if code == 0 {
		t.Fatalf("exit 0 with the ledger down and %d charges unsettled:\n%s", acknowledged, n.LogTail(20))
	}
	if !strings.Contains(n.LogTail(100), "final settle failed") {
		t.Fatalf("the log does not say the final settle failed:\n%s", n.LogTail(20))
	}
	if err := srv.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := n.Start(ctx); err != nil {
		t.Fatal(err)
	}
	tc.converge(30 * time.Second)
	tc.settleAll(30 * time.Second)
	if u := tc.used("kept"); u != int64(20+acknowledged) {
		t.Fatalf("after the restart the ledger holds %d units, want the %d acknowledged", u, 20+acknowledged)
	}
}

// Two processes as one node id that passed the start check together (two
// replicas given one --node-id): the one that started first finds the
// later one's start in the ledger, says so and exits 1 without handing its
// reservations back, which are the later process's now.
func TestEarlierProcessOfOneNodeIDStops(t *testing.T) {
	tc := newTestCluster(t, 3)
	victim := tc.Nodes[2]
	ctx := context.Background()
	// What the later process's registration leaves in the ledger.
	if _, err := tc.ledger.RegisterNode(ctx, victim.ID, "later-inc"); err != nil {
		t.Fatal(err)
	}
	if err := tc.ledger.RecordStart(ctx, victim.ID, "later-inc", flush.NodeStart{Build: "v-later", Process: "later"}); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	code, _ := victim.Wait(wctx)
	log := victim.LogTail(40)
	if code != 1 || !strings.Contains(log, "another process started as this node id after this one") || !strings.Contains(log, "later-inc") {
		t.Fatalf("the earlier process: exit %d; want 1 and the reason in its log:\n%s", code, log)
	}
	tc.converge(30 * time.Second) // the others go on without it
}

// Two real processes given one --node-id, started together: one of them
// exits 1, saying why, and the other joins the ring and serves. Which check
// stops it depends on the interleaving: when the first registers before
// the second looks, the second refuses to start (checkNodeIDFree); when
// both looked before either registered, the first to register finds the
// other's start and stops (fence.go).
func TestTwoProcessesStartedAsOneNodeID(t *testing.T) {
	tc := newTestCluster(t, 3)
	var twins []*Node
	for i := range 2 {
		n, err := tc.newNode(len(tc.Nodes) + i) // an address, ports and a data dir of its own
		if err != nil {
			t.Fatal(err)
		}
		n.ID = "twin"
		n.args[slices.Index(n.args, "--node-id")+1] = n.ID
		twins = append(twins, n)
	}
	ctx := context.Background()
	for _, n := range twins {
		if err := n.Start(ctx); err != nil {
			t.Fatal(err)
		}
	}
	var stopped, survivor *Node
	tc.eventually(30*time.Second, "one of the twins to exit", func() bool {
		for i, n := range twins {
			if !n.Running() {
				stopped, survivor = n, twins[1-i]
				return true
			}
		}
		return false
	})
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	code, _ := stopped.Wait(wctx)
	if log := stopped.LogTail(60); code != 1 || !strings.Contains(log, "another process started as this node id after this one") &&
		!strings.Contains(log, "another process runs as this node id: refusing to start") {
		t.Fatalf("the twin that stopped: exit %d; want 1 and the reason in its log:\n%s", code, log)
	}
	if !survivor.Running() {
		t.Fatalf("both twins exited:\n%s", survivor.LogTail(30))
	}
	if strings.Contains(stopped.LogTail(60), "refusing to start") {
		t.Log("the second twin refused to start: the first had registered before it looked")
	} else {
		t.Log("both twins started; the one that registered first found the other and stopped")
	}
	tc.mu.Lock()
	tc.Nodes = append(tc.Nodes, survivor) // converged with the others, and stopped at the end
	tc.mu.Unlock()
	tc.converge(60 * time.Second)
}

// An Idempotency-Key names one request across its owner's crash: a key
// charged and settled before a SIGKILL, and one charged just before it
// (in the log only), are refused ID_REUSED for another request (another
// Target) by the restarted process, replayed for their own, and billed
// once. The served retries of a key count across the kill too: under
// --dedup-max-replays 2, a key retried once before it and once after it
// is refused REPLAY_LIMIT the next time.
func TestAKeysRequestSurvivesAKill(t *testing.T) {
	tc := newTestCluster(t, 1, "--dedup-max-replays", "2")
	tc.hardAccounts(snapshot.Plan{ID: "keys", MonthlyQuota: 100, Hard: true}, "keyed")
	ctx := context.Background()
	n := tc.Nodes[0]
	charge := func(key string, target uint64) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		var op Op
		tc.conns.ChargeRouted(ctx, n, &pb.ChargeRequest{Account: "keyed", EventId: key, ClientId: true, Route: "GET /v1/tasks/{id}", Units: 1, Target: target}, &op)
		if op.Reason == "" {
			t.Fatalf("key %s: no decision: %s", key, op.Err)
		}
		return op.Reason
	}
	if r := charge("settled", 7); r != "ok" {
		t.Fatalf("first key: %s", r)
	}
	tc.settleAll(30 * time.Second)
	if r := charge("logged", 8); r != "ok" {
		t.Fatalf("second key: %s", r)
	}
	if r := charge("logged", 8); r != "replayed" {
		t.Fatalf("second key's retry: %s", r)
	}
	if err := n.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := n.Start(ctx); err != nil {
		t.Fatal(err)
	}
	tc.converge(30 * time.Second)
	for _, c := range []struct {
		key    string
		target uint64
		want   string
	}{{"settled", 9, "id_reused"}, {"logged", 9, "id_reused"}, {"settled", 7, "replayed"}, {"logged", 8, "replayed"}} {
		if r := charge(c.key, c.target); r != c.want {
			t.Errorf("after the kill, key %q for request %d: %s, want %s", c.key, c.target, r, c.want)
		}
	}
	if r := charge("logged", 8); r != "replay_limit" {
		t.Errorf("after the kill, the third retry of key \"logged\": %s, want replay_limit (--dedup-max-replays 2)", r)
	}
	tc.settleAll(30 * time.Second)
	if u := tc.used("keyed"); u != 2 {
		t.Fatalf("the ledger holds %d units, want 2 (two keys, each billed once)", u)
	}
}
