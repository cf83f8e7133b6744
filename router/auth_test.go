package router

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

const testRPCToken = "rpc-token-0123456789abcdef"

// authCall runs the interceptor on a call whose incoming metadata is md, and
// reports whether the handler ran and the error.
func authCall(token string, md metadata.MD) (ran bool, err error) {
	ctx := metadata.NewIncomingContext(context.Background(), md)
	_, err = authInterceptor(token)(ctx, nil, nil, func(context.Context, any) (any, error) {
		ran = true
		return nil, nil
	})
	return ran, err
}

func TestAuthInterceptor(t *testing.T) {
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
		ran, err := authCall(testRPCToken, tc.md)
		if tc.ok {
			if !ran || err != nil {
				t.Errorf("%s: ran %v, %v; want the handler to run", name, ran, err)
			}
			continue
		}
		if ran || status.Code(err) != codes.Unauthenticated || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: ran %v, %v; want Unauthenticated saying %q before the handler", name, ran, err, tc.want)
		}
	}
	// While a token is rotated a node accepts the new and the old one.
	const oldToken = "old-rpc-token-0123456789"
	ctxWith := func(tok string) context.Context {
		return metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer "+tok))
	}
	h := func(context.Context, any) (any, error) { return nil, nil }
	both := authInterceptor(testRPCToken, oldToken)
	for tok, ok := range map[string]bool{testRPCToken: true, oldToken: true, "third-rpc-token-0123456789": false} {
		if _, err := both(ctxWith(tok), nil, nil, h); (err == nil) != ok {
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

// BenchmarkAuthInterceptor is what --rpc-token adds to every internal call
// (one SHA-256 of the token sent, a constant-time compare).
func BenchmarkAuthInterceptor(b *testing.B) {
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer "+testRPCToken))
	in := authInterceptor(testRPCToken)
	h := func(context.Context, any) (any, error) { return nil, nil }
	b.ReportAllocs()
	for b.Loop() {
		if _, err := in(ctx, nil, nil, h); err != nil {
			b.Fatal(err)
		}
	}
}
