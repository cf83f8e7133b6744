package router

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// selfRing names this node the owner of every account.
type selfRing struct{}

func (selfRing) Owner(string) (ring.Meta, bool) { return ring.Meta{ID: "n1"}, true }
func (selfRing) Epoch() uint64                  { return 1 }
func (selfRing) Self() ring.Meta                { return ring.Meta{ID: "n1"} }
func (selfRing) View() ring.View                { return ring.View{} }
func (selfRing) Layout() ring.Layout            { return ring.Layout{} }

// openSelfOwned opens an engine that owns account "acme" (quota 10) and a
// router whose ring names this node the owner of everything.
func openSelfOwned(t *testing.T, owns func(string) bool) *Router {
	t.Helper()
	return openSelfOwnedWith(t, func(o *engine.Options) { o.Owns = owns })
}

// openSelfOwnedWith is openSelfOwned with the engine's options set by opt.
func openSelfOwnedWith(t *testing.T, opt func(*engine.Options)) *Router {
	t.Helper()
	l, err := wal.Open(wal.Options{Dir: t.TempDir(), NodeID: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	opts := engine.Options{Log: l, Clock: engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))}
	opt(&opts)
	e, err := engine.Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	s := &snapshot.Snapshot{Version: 1, Plans: []snapshot.Plan{{ID: "p", MonthlyQuota: 10}}, Accounts: []snapshot.Account{{ID: "acme", Plan: "p"}}}
	if err := s.Build(); err != nil {
		t.Fatal(err)
	}
	if err := e.SetSnapshot(s, engine.AllSettled); err != nil {
		t.Fatal(err)
	}
	r, err := New(Config{Engine: e, Ring: selfRing{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// A usage read while the node holds every decision (a pause) is
// quota-unavailable, retried, as a charge is: it was a 500 internal-error
// at the usage endpoint, and gRPC's Unknown ("did not answer") to a peer,
// and its text blamed the ledger.
func TestUsageDuringAHoldIsUnavailable(t *testing.T) {
	r := openSelfOwnedWith(t, func(o *engine.Options) { o.Hold = func() error { return errors.New("paused") } })
	ctx := context.Background()
	_, err := r.Usage(ctx, "acme")
	if !errors.Is(err, ErrUnavailable) || strings.Contains(err.Error(), "ledger") {
		t.Errorf("Router.Usage during a hold: %v, want ErrUnavailable, not blaming the ledger", err)
	}
	_, err = r.Server().Usage(ctx, &pb.UsageRequest{Account: "acme", Hops: 1})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("Server.Usage during a hold: %v (code %s), want Unavailable", err, status.Code(err))
	}
}

// A routed charge whose caller's deadline ran out answers quota-unavailable
// (outcome unknown: retry with the same event id), not INTERNAL.
func TestRoutedChargeTimeoutIsUnavailable(t *testing.T) {
	r := openSelfOwned(t, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	replies := make([]*pb.ChargeReply, 1)
	(&server{r: r}).routeOne(ctx, &pb.ChargeRequest{Account: "acme", EventId: "e1", ClientId: true, Units: 1}, 0, replies, "")
	if rep := replies[0]; rep.GetError().GetCode() != pb.Error_QUOTA_UNAVAILABLE {
		t.Fatalf("a routed charge past its deadline: %v, want quota-unavailable", rep)
	}
}

// A draining node's engine refuses an account its ring view still names it
// the owner of: the answer says quota-unavailable, never an empty reply (no
// decision, no error, no WrongOwner), which a caller read as a decision with
// no reason. (Found by the chaos harness during rolling restarts.)
func TestNotOwnerWhileTheRingSaysSelf(t *testing.T) {
	r := openSelfOwned(t, func(string) bool { return false }) // draining
	srv := r.Server()
	ctx := context.Background()

	reps, err := srv.Charge(ctx, &pb.ChargeBatch{Charges: []*pb.ChargeRequest{{Account: "acme", EventId: "e1", ClientId: true, Units: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	if rep := reps.Replies[0]; rep.GetError().GetCode() != pb.Error_QUOTA_UNAVAILABLE || rep.Decision != nil || rep.WrongOwner != nil {
		t.Fatalf("charge: %v, want quota-unavailable", rep)
	}
	refs, err := srv.Refund(ctx, &pb.RefundBatch{Refunds: []*pb.RefundRequest{{Account: "acme", EventId: "e1"}}})
	if err != nil {
		t.Fatal(err)
	}
	if rep := refs.Replies[0]; rep.GetError().GetCode() != pb.Error_QUOTA_UNAVAILABLE || rep.Decision != nil {
		t.Fatalf("refund: %v, want quota-unavailable", rep)
	}
	if _, err := srv.Usage(ctx, &pb.UsageRequest{Account: "acme"}); err == nil {
		t.Fatal("usage answered from a node that does not own the account")
	}
}

// blockedReserver holds every reservation until release is closed,
// announcing each on entered.
type blockedReserver struct{ entered, release chan struct{} }

func (b blockedReserver) Reserve(ctx context.Context, _ engine.ReserveRequest) (engine.ReserveResult, error) {
	b.entered <- struct{}{}
	<-b.release
	return engine.ReserveResult{}, errors.New("the test's ledger reserves nothing")
}

func (blockedReserver) Release(context.Context, string, []shard.Alloc, uint64) error { return nil }

// A charge whose deadline (the forwarding node's, carried by gRPC) passes
// at the owner while it waits, here behind another charge's reservation,
// answers quota-unavailable with the outcome unknown: it answered INTERNAL
// "context deadline exceeded", which the forwarding node's front turned
// into 500 internal-error for a charge a retry decides.
func TestOwnerAnswersAPassedDeadlineUnavailable(t *testing.T) {
	l, err := wal.Open(wal.Options{Dir: t.TempDir(), NodeID: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	res := blockedReserver{entered: make(chan struct{}, 1), release: make(chan struct{})}
	e, err := engine.Open(engine.Options{Log: l, Clock: engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Reserver: res})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	s := &snapshot.Snapshot{Version: 1, Plans: []snapshot.Plan{{ID: "p", MonthlyQuota: 10, Hard: true}}, Accounts: []snapshot.Account{{ID: "acme", Plan: "p"}}}
	if err := s.Build(); err != nil {
		t.Fatal(err)
	}
	if err := e.SetSnapshot(s, engine.AllSettled); err != nil {
		t.Fatal(err)
	}
	r, err := New(Config{Engine: e, Ring: selfRing{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	srv := r.Server()
	first := make(chan struct{})
	go func() {
		defer close(first)
		_, _ = srv.Charge(context.Background(), &pb.ChargeBatch{Charges: []*pb.ChargeRequest{{Account: "acme", EventId: "e1", ClientId: true, Units: 1}}})
	}()
	<-res.entered // e1 holds the account's reservation round trip
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	reps, err := srv.Charge(ctx, &pb.ChargeBatch{Charges: []*pb.ChargeRequest{{Account: "acme", EventId: "e2", ClientId: true, Units: 1}}})
	close(res.release)
	<-first
	if err != nil {
		t.Fatal(err)
	}
	rep := reps.Replies[0]
	if rep.GetError().GetCode() != pb.Error_QUOTA_UNAVAILABLE || !strings.Contains(rep.GetError().GetMessage(), "retry with the same event id") {
		t.Fatalf("a charge past its deadline at the owner: %v, want quota-unavailable, retry with the same event id", rep)
	}
	if _, err := resultFromPB(rep); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("the forwarding node reads it as %v, want ErrUnavailable", err)
	}
}

// configNode is a node in a client's ring (hangingNode's view) whose
// Config is a real router's.
type configNode struct {
	hangingNode
	r *Router
}

func (n *configNode) Config(ctx context.Context, req *pb.ConfigRequest) (*pb.ConfigReply, error) {
	return n.r.Server().Config(ctx, req)
}

// A ledger whose config never changed is at version 0: a client holding
// nothing asked with KnownVersion 0, got "unchanged", and never loaded it
// (its middleware answered quota-unavailable for every key until the first
// change of config).
func TestClientLoadsAConfigOfVersionZero(t *testing.T) {
	r := openSelfOwned(t, nil)
	s := &snapshot.Snapshot{Version: 0, Plans: []snapshot.Plan{{ID: "p", MonthlyQuota: 10}}, Accounts: []snapshot.Account{{ID: "zero", Plan: "p"}}}
	if err := s.Build(); err != nil {
		t.Fatal(err)
	}
	if err := r.cfg.Engine.SetSnapshot(s, engine.AllSettled); err != nil {
		t.Fatal(err)
	}
	if v := r.cfg.Engine.Snapshot().Version; v != 0 {
		t.Fatalf("the node's config is at version %d, want 0", v)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	serveFake(t, lis, &configNode{hangingNode: hangingNode{addr: lis.Addr().String()}, r: r})
	c, err := DialOptions{RefreshInterval: -1}.Dial(context.Background(), lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if s := c.Snapshot(); s == nil || !s.HasAccount("zero") {
		t.Fatalf("config after Dial: %+v; want version 0 with account zero", s)
	}
}

// Every client whose version differs asks for the config after a change:
// one encoding per snapshot, shared, not one per caller (200,000 accounts
// with a key: 180 MB allocated each).
func TestConfigIsEncodedOncePerSnapshot(t *testing.T) {
	r := openSelfOwned(t, nil)
	srv := r.Server()
	a, err := srv.Config(context.Background(), &pb.ConfigRequest{KnownVersion: -1})
	if err != nil {
		t.Fatal(err)
	}
	b, err := srv.Config(context.Background(), &pb.ConfigRequest{KnownVersion: -1})
	if err != nil {
		t.Fatal(err)
	}
	if len(a.Snapshot) == 0 || &a.Snapshot[0] != &b.Snapshot[0] {
		t.Fatal("two callers got two encodings of one snapshot")
	}
	s := &snapshot.Snapshot{Version: 2, Plans: []snapshot.Plan{{ID: "p", MonthlyQuota: 10}}, Accounts: []snapshot.Account{{ID: "other", Plan: "p"}}}
	if err := s.Build(); err != nil {
		t.Fatal(err)
	}
	if err := r.cfg.Engine.SetSnapshot(s, engine.AllSettled); err != nil {
		t.Fatal(err)
	}
	c, err := srv.Config(context.Background(), &pb.ConfigRequest{KnownVersion: 1})
	if err != nil || c.Version != 2 || !strings.Contains(string(c.Snapshot), "other") {
		t.Fatalf("after a change: version %d %v; want the new snapshot's encoding", c.GetVersion(), err)
	}
}
