package router_test

import (
	"context"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/router/pb"
)

// grpcAPI is a real gRPC upstream (any service would do; this one is at
// hand): Usage fails with INTERNAL for the account "fail" and NOT_FOUND
// for "missing".
type grpcAPI struct{ pb.UnimplementedQuotaServer }

func (grpcAPI) Usage(_ context.Context, req *pb.UsageRequest) (*pb.UsageReply, error) {
	switch req.Account {
	case "fail":
		return nil, status.Error(codes.Internal, "the upstream broke")
	case "missing":
		return nil, status.Error(codes.NotFound, "no such account")
	}
	return &pb.UsageReply{Known: true, Node: "upstream"}, nil
}

// A gRPC client calls a gRPC server through the proxy (h2c both ways): an OK
// call is billed, a failed one refunded, and refusals arrive as gRPC
// statuses the client understands.
func TestProxyGRPCUpstream(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	pb.RegisterQuotaServer(srv, grpcAPI{})
	go srv.Serve(lis)
	defer srv.Stop()

	acct := account{id: "grpc", key: keyOf("grpc"), plan: monthly("m7", 7)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 3, clock: engine.NewManualClock(june28), upstream: "h2c://" + lis.Addr().String()})
	proxy := c.notOwner(t, acct.id).HTTPAddr()
	conn, err := grpc.NewClient(proxy, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	api := pb.NewQuotaClient(conn)
	call := func(key, account string) (*pb.UsageReply, metadata.MD, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+key)
		var header, trailer metadata.MD // a trailers-only answer's headers arrive as trailer
		rep, err := api.Usage(ctx, &pb.UsageRequest{Account: account}, grpc.Header(&header), grpc.Trailer(&trailer))
		return rep, metadata.Join(header, trailer), err
	}

	rep, md, err := call(acct.key, "ok")
	if err != nil || rep.Node != "upstream" || first(md, "x-quota-remaining") != "4" {
		t.Fatalf("OK call: %v, %v, metadata %v", rep, err, md)
	}
	before := c.refunds()
	if _, _, err := call(acct.key, "fail"); status.Code(err) != codes.Internal {
		t.Fatalf("failing call: %v, want INTERNAL from the upstream", err)
	}
	waitFor(t, 5*time.Second, "the refund of the failed call", func() bool { return c.refunds() == before+1 })
	// The upstream's own status reaches the client through the refund: the
	// front must not flush a trailers-only answer's head before refunding
	// (the client would read INTERNAL, "closed the stream without sending
	// trailers", whatever the upstream said).
	if _, _, err := call(acct.key, "missing"); status.Code(err) != codes.NotFound {
		t.Fatalf("a call the upstream answers NOT_FOUND: %v, want NOT_FOUND", err)
	}
	waitFor(t, 5*time.Second, "the refund of the NOT_FOUND call", func() bool { return c.refunds() == before+2 })

	if _, _, err := call("qr_nope", "ok"); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("unknown key: %v, want UNAUTHENTICATED", err)
	}
	if _, _, err := call(acct.key, "ok"); err != nil { // 1 unit left
		t.Fatal(err)
	}
	_, md, err = call(acct.key, "ok")
	if status.Code(err) != codes.ResourceExhausted || first(md, "x-quota-problem") != router.ProblemQuotaExceeded || first(md, "retry-after") != "216000" {
		t.Fatalf("over the quota: %v, metadata %v; want RESOURCE_EXHAUSTED with the problem type and Retry-After", err, md)
	}
	u := do(t, "http://"+proxy, "GET", "/v1/usage", acct.key, nil).usage(t)
	if u.Used != 6 || u.Routes["POST /quotaring.v1.Quota/Usage"] != 6 {
		t.Fatalf("usage %+v: want the two OK calls billed", u)
	}
}

func first(md metadata.MD, key string) string {
	if v := md.Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}
