package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/quotaring/quotaring/internal/loadgen"
	"github.com/quotaring/quotaring/router/pb"
)

// quotad bench cluster on a cluster without its accounts says how to make
// them (--setup) instead of only "refused: UNKNOWN_ACCOUNT".
func TestBenchClusterWithoutItsAccounts(t *testing.T) {
	n := startAdminTestNode(t)
	_, err := runQuotad(t, "bench", "cluster", "--nodes", n.RPCAddr(), "--accounts", "10", "--concurrency", "1", "--duration", "1s")
	if err == nil || !strings.Contains(err.Error(), "UNKNOWN_ACCOUNT") || !strings.Contains(err.Error(), "--setup --ledger DSN") {
		t.Fatalf("bench cluster without bench accounts: %v; want the refusal and how to create them", err)
	}
}

// --nodes that cannot be a node's RPC address is named before any load:
// it failed at warm-up with gRPC's "missing port in address".
func TestBenchClusterChecksNodes(t *testing.T) {
	for _, a := range []string{"127.0.0.31", "http://127.0.0.1:7400", "127.0.0.1:0"} {
		_, err := runQuotad(t, "bench", "cluster", "--nodes", a, "--duration", "1s")
		if err == nil || !strings.Contains(err.Error(), `--nodes "`+a+`": want a node's RPC address, host:port`) {
			t.Errorf("bench cluster --nodes %s: %v; want it named as not host:port", a, err)
		}
	}
}

// Calls that fail while measuring are no charges/s: the row counts only
// the calls that succeeded, and the command fails, so that a script does
// not record a run of refusals as a measurement.
func TestBenchClusterFailsWhenCallsFail(t *testing.T) {
	n := startAdminTestNode(t)
	// The gRPC client, and the embedded one through the node (Gateway).
	for _, client := range [][]string{{}, {"--mode", "routed", "--client", "embedded"}} {
		var stdout bytes.Buffer
		root := newRootCmd()
		root.SetArgs(append([]string{"bench", "cluster", "--nodes", n.RPCAddr(), "--accounts", "10", "--concurrency", "2", "--duration", "300ms", "--warm=false"}, client...))
		root.SetOut(&stdout)
		root.SetErr(io.Discard)
		err := root.ExecuteContext(context.Background())
		out := stdout.String()
		if err == nil || !strings.Contains(err.Error(), "calls failed") || !strings.Contains(strings.ToLower(out), "first error: refused: unknown_account") {
			t.Fatalf("bench cluster %v whose every call is refused: %v; want it to fail, naming the refusal\n%s", client, err, out)
		}
		rows := 0
		for _, line := range strings.Split(out, "\n") {
			if f := strings.Fields(line); len(f) > 2 && f[0] == "2" {
				rows++
				if f[1] != "0" || f[2] != "0" {
					t.Fatalf("row %q: refused calls counted as charges/s or calls/s", line)
				}
			}
		}
		if rows != 1 {
			t.Fatalf("want one row for concurrency 2 in:\n%s", out)
		}
	}
}

// Sizes past any sensible run are typos, refused before anything starts.
func TestBenchBounds(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"bench", "cluster", "--nodes", "127.0.0.1:1", "--batch", "20000"}, "--batch 20000: want 1 to 10000 charges per call"},
		{[]string{"bench", "cluster", "--nodes", "127.0.0.1:1", "--concurrency", "64,1000000"}, `--concurrency "64,1000000": want comma-separated numbers from 1 to 100000`},
		{[]string{"bench", "cluster", "--nodes", "127.0.0.1:1", "--accounts", "100000000"}, "--accounts 100000000: want 1 to 10000000"},
		{[]string{"bench", "cluster", "--nodes", "127.0.0.1:1", "--setup"}, "--setup needs --ledger"},
		{[]string{"bench", "cluster", "--nodes", "127.0.0.1:1", "--ledger", "sqlite:/tmp/x.db"}, "--ledger is read only with --setup"},
		{[]string{"bench", "engine", "--accounts", "0"}, "--accounts 0: want 1 to 10000000"},
	} {
		if _, err := runQuotad(t, tc.args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("quotad %s: %v, want %q", strings.Join(tc.args, " "), err, tc.want)
		}
	}
}

// Ctrl-C in the middle of a row prints what it measured so far, marked as
// stopped, instead of dropping it.
func TestBenchClusterStoppedPrintsItsRow(t *testing.T) {
	n := startAdminTestNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second) // the Ctrl-C, after the 200 ms warm-up
	defer cancel()
	var stdout bytes.Buffer
	root := newRootCmd()
	root.SetArgs([]string{"bench", "cluster", "--nodes", n.RPCAddr(), "--accounts", "10", "--concurrency", "2,4", "--duration", "2s", "--warm=false"})
	root.SetOut(&stdout)
	root.SetErr(io.Discard)
	err := root.ExecuteContext(ctx)
	if exitCode(err) != 130 || !strings.Contains(stdout.String(), "(stopped after") || strings.Contains(stdout.String(), "\n     4 ") {
		t.Fatalf("bench cluster stopped during its first row: %v (exit %d)\n%s\nwant that row, marked as stopped, and no other, and exit 130", err, exitCode(err), stdout.String())
	}
}

// bench engine too: the row it stopped, marked, and exit 130. It printed
// "context canceled" and exit 1, and no row.
func TestBenchEngineStoppedPrintsItsRow(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var stdout bytes.Buffer
	root := newRootCmd()
	root.SetArgs([]string{"bench", "engine", "--targets", "engine-nosync", "--accounts", "10", "--concurrency", "1,2", "--duration", "3s", "--dir", t.TempDir()})
	root.SetOut(&stdout)
	root.SetErr(io.Discard)
	err := root.ExecuteContext(ctx)
	if exitCode(err) != 130 || !strings.Contains(stdout.String(), "(stopped after") || strings.Contains(stdout.String(), "engine-nosync       2") {
		t.Fatalf("bench engine stopped during its first row: %v (exit %d)\n%s\nwant that row, marked as stopped, and no other, and exit 130", err, exitCode(err), stdout.String())
	}
}

// QUOTAD_LEDGER, exported for the ledger commands, is no --ledger typed
// without --setup: the bench goes on (here to a node that is not there).
func TestBenchClusterLedgerFromEnvWithoutSetup(t *testing.T) {
	t.Setenv("QUOTAD_LEDGER", "sqlite:"+filepath.Join(t.TempDir(), "ledger.db"))
	_, err := runQuotad(t, "bench", "cluster", "--nodes", "127.0.0.1:1", "--duration", "1s", "--concurrency", "1")
	if err == nil || strings.Contains(err.Error(), "--setup") {
		t.Fatalf("bench cluster with QUOTAD_LEDGER set: %v, want it to go on to the nodes (and fail there)", err)
	}
}

// barrierOwner is an owner whose Charge answers only once every owner of
// the call has been asked: calls made one after another never get there.
type barrierOwner struct {
	pb.QuotaClient
	arrived *sync.WaitGroup
}

func (o barrierOwner) Charge(ctx context.Context, b *pb.ChargeBatch, _ ...grpc.CallOption) (*pb.ChargeReplies, error) {
	o.arrived.Done()
	done := make(chan struct{})
	go func() { o.arrived.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	rep := &pb.ChargeReplies{}
	for range b.Charges {
		rep.Replies = append(rep.Replies, &pb.ChargeReply{Decision: &pb.Decision{Reason: pb.Reason_OK}})
	}
	return rep, nil
}

// Direct mode sends a call's charges to their owners at once, as a routed
// node fans a batch out: one after another, a direct call cost the sum of
// the owners' round trips.
func TestBenchDirectCallsOwnersAtOnce(t *testing.T) {
	var arrived sync.WaitGroup
	arrived.Add(3)
	conns := map[string]pb.QuotaClient{}
	for _, a := range []string{"a:1", "b:1", "c:1"} {
		conns[a] = &barrierOwner{arrived: &arrived} // NB: pointers: equal values would be one map key, one group
	}
	owners := func(account string) string { return account + ":1" }
	reqs := []*pb.ChargeRequest{{Account: "a"}, {Account: "b"}, {Account: "c"}, {Account: "a"}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := benchCall(ctx, "direct", nil, owners, conns, reqs); err != nil {
		t.Fatalf("benchCall: %v, want the three owners asked at once", err)
	}
}

// The RPC client at a node's HTTP ports is told so, as the embedded
// client's Dial is (router.ExplainTLSMismatch): through the public port the
// front's answer read as a key missing, and the admin port's as "frame too
// large" with no hint.
func TestBenchClusterExplainsAWrongPort(t *testing.T) {
	n := startAdminTestNode(t)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--nodes", n.HTTPAddr()}, "answered as a node's public HTTP port, --http-addr"},
		{[]string{"--nodes", n.HTTPAddr(), "--mode", "direct"}, "answered as a node's public HTTP port, --http-addr"},
		{[]string{"--nodes", n.AdminAddr(), "--mode", "direct"}, "--admin-addr; dial the node's RPC port, --rpc-addr"},
	} {
		_, err := runQuotad(t, append([]string{"bench", "cluster", "--accounts", "10", "--concurrency", "1", "--duration", "1s"}, c.args...)...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("bench cluster %v: %v, want it to say %q", c.args, err, c.want)
		}
	}
}

// Ctrl-C before the first row (setup, warm-up) exits 130 as every bench's
// interrupt does, not 1 with "context canceled".
func TestBenchClusterInterruptedBeforeItsFirstRow(t *testing.T) {
	n := startAdminTestNode(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	root := newRootCmd()
	root.SetArgs([]string{"bench", "cluster", "--nodes", n.RPCAddr(), "--accounts", "10", "--duration", "1s"})
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	err := root.ExecuteContext(ctx)
	var exit *exitError
	if !errors.As(err, &exit) || exit.code != 130 {
		t.Fatalf("bench cluster interrupted before its first row: %v, want exit 130", err)
	}
}

// The group-commit ratio compares the most callers with the fewest, in
// whatever order --concurrency lists them: 64,1 compared 1 against 64.
func TestPrintRatiosOrdersConcurrency(t *testing.T) {
	var out bytes.Buffer
	printRatios(&out, map[string]loadgen.Report{"engine64": {Ops: 1, OpsPerSec: 100_000}, "engine1": {Ops: 1, OpsPerSec: 5_000}}, []int{64, 1})
	if !strings.Contains(out.String(), "engine (Sync) at 64 callers vs 1: 20x") {
		t.Errorf("ratios:\n%s", out.String())
	}
}
