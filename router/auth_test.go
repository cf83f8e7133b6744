package router

import (
	"context"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/quotaring/quotaring/router/pb"
)

const testRPCToken = "rpc-token-0123456789abcdef"

func TestTokenCheck(t *testing.T) {
	for name, tc := range map[string]struct {
		md   metadata.MD
		ok   bool
		want string
	}{
		"the token":         {metadata.Pairs("authorization", "Bearer "+testRPCToken), true, ""},
		"lower-case scheme": {metadata.Pairs("authorization", "bearer "+testRPCToken), true, ""},
		"no metadata":       {nil, false, "requires the cluster's RPC token"},
		"another scheme":    {metadata.Pairs("authorization", "Basic "+testRPCToken), false, "requires the cluster's RPC token"},
		"a wrong token":     {metadata.Pairs("authorization", "Bearer "+testRPCToken+"x"), false, "wrong RPC token"},
		"a prefix of it":    {metadata.Pairs("authorization", "Bearer "+testRPCToken[:16]), false, "wrong RPC token"},
	} {
		err := tokenCheck(testRPCToken)(tc.md)
		if tc.ok {
			if err != nil {
				t.Errorf("%s: %v; want the call let through", name, err)
			}
			continue
		}
		if status.Code(err) != codes.Unauthenticated || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want Unauthenticated saying %q", name, err, tc.want)
		}
	}
	// While a token is rotated a node accepts the new and the old one.
	const oldToken = "old-rpc-token-0123456789"
	both := tokenCheck(testRPCToken, oldToken)
	for tok, ok := range map[string]bool{testRPCToken: true, oldToken: true, "third-rpc-token-0123456789": false} {
		if err := both(metadata.Pairs("authorization", "Bearer "+tok)); (err == nil) != ok {
			t.Errorf("rotating, token %q: %v, want accepted %v", tok, err, ok)
		}
	}
	if opts := ServerAuth("", ""); opts != nil {
		t.Fatalf("ServerAuth without a token: %d options, want none (calls not checked)", len(opts))
	}
	if err := CheckRPCToken("short"); err == nil || !strings.Contains(err.Error(), "is 5 characters; use at least 16") {
		t.Fatalf("CheckRPCToken(a 5-character token): %v", err)
	}
}

// countingQuota counts the Charge calls that reach it.
type countingQuota struct {
	pb.UnimplementedQuotaServer
	calls atomic.Int64
}

func (q *countingQuota) Charge(_ context.Context, b *pb.ChargeBatch) (*pb.ChargeReplies, error) {
	q.calls.Add(1)
	return &pb.ChargeReplies{Replies: make([]*pb.ChargeReply, len(b.Charges))}, nil
}

// TestServerAuthBeforeTheMessage: over a real gRPC connection, a call
// without the token is refused before the server reads its message: a
// message past the server's size limit is answered Unauthenticated, not
// ResourceExhausted, and no handler runs; with the token the same server
// serves.
func TestServerAuthBeforeTheMessage(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(ServerAuth(testRPCToken)...)
	q := &countingQuota{}
	pb.RegisterQuotaServer(srv, q)
	go srv.Serve(lis)
	defer srv.Stop()
	dial := func(token string) pb.QuotaClient {
		conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(),
			append(NodeDialOptions(token, nil), grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20)))...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return pb.NewQuotaClient(conn)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	small := &pb.ChargeBatch{Charges: []*pb.ChargeRequest{{Account: "acct-1", Units: 1}}}
	huge := &pb.ChargeBatch{Charges: []*pb.ChargeRequest{{Account: strings.Repeat("a", 8<<20), Units: 1}}}

	anon, wrong := dial(""), dial(testRPCToken+"x")
	for name, call := range map[string]func() error{
		"no token, small":    func() error { _, err := anon.Charge(ctx, small); return err },
		"no token, 8 MiB":    func() error { _, err := anon.Charge(ctx, huge); return err },
		"wrong token, 8 MiB": func() error { _, err := wrong.Charge(ctx, huge); return err },
	} {
		if err := call(); status.Code(err) != codes.Unauthenticated {
			t.Errorf("%s: %v; want Unauthenticated before the message is read", name, err)
		}
	}
	if n := q.calls.Load(); n != 0 {
		t.Fatalf("%d calls without the token reached the handler", n)
	}
	good := dial(testRPCToken)
	if _, err := good.Charge(ctx, small); err != nil {
		t.Fatalf("with the token: %v", err)
	}
	if _, err := good.Charge(ctx, huge); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("with the token, 8 MiB: %v; want the server's size limit (ResourceExhausted)", err)
	}
	if n := q.calls.Load(); n != 1 {
		t.Fatalf("%d calls reached the handler, want 1", n)
	}
}

// BenchmarkTokenCheck is what --rpc-token adds to every internal call
// (one SHA-256 of the token sent, a constant-time compare).
func BenchmarkTokenCheck(b *testing.B) {
	md := metadata.Pairs("authorization", "Bearer "+testRPCToken)
	check := tokenCheck(testRPCToken)
	b.ReportAllocs()
	for b.Loop() {
		if err := check(md); err != nil {
			b.Fatal(err)
		}
	}
}

// CredentialsRefused tells a node that turned the caller's credentials
// away (its token, its certificate, TLS on one side only) from one that did
// not answer: only the first keeps a joining node from serving.
func TestCredentialsRefused(t *testing.T) {
	unavailable := func(msg string) error { return status.Error(codes.Unavailable, msg) }
	for _, tc := range []struct {
		err     error
		withTLS bool
		want    bool
	}{
		{status.Error(codes.Unauthenticated, "router: wrong RPC token"), false, true},
		{status.Error(codes.PermissionDenied, "no"), true, true},
		{unavailable(`connection error: desc = "error reading server preface: remote error: tls: unknown certificate authority"`), true, true},
		{unavailable(`connection error: desc = "transport: authentication handshake failed: tls: failed to verify certificate: x509: certificate signed by unknown authority"`), true, true},
		{unavailable(`connection error: desc = "transport: authentication handshake failed: tls: first record does not look like a TLS handshake"`), true, true},
		{unavailable(`connection error: desc = "error reading server preface: EOF"`), false, true}, // a TLS node closes a plaintext caller's connection
		{unavailable(`connection error: desc = "transport: failed to write client preface: write tcp: broken pipe"`), true, true},
		{unavailable(`connection error: desc = "transport: failed to write client preface: write tcp: broken pipe"`), false, false},
		{unavailable(`connection error: desc = "transport: Error while dialing: dial tcp 127.0.0.1:7400: connect: connection refused"`), false, false},
		{unavailable(`connection error: desc = "transport: Error while dialing: dial tcp 127.0.0.1:7400: connect: connection refused"`), true, false},
		{status.Error(codes.DeadlineExceeded, "context deadline exceeded"), true, false},
		{context.DeadlineExceeded, false, false},
		{nil, false, false},
	} {
		if got := CredentialsRefused(tc.err, tc.withTLS); got != tc.want {
			t.Errorf("CredentialsRefused(%v, TLS %v) = %v, want %v", tc.err, tc.withTLS, got, tc.want)
		}
	}
}
