package router

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"fmt"
	"net"
	"slices"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	grpcpeer "google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
)

// The RPC token.
//
// The internal gRPC API charges and refunds any account and hands out the
// config snapshot, so whoever reaches a node's RPC port can spend every
// customer's quota. Keep that port private to the cluster and its embedded
// clients; and, as a second lock, give every node the same RPC token
// (quotad serve --rpc-token): each call then carries it as
// "authorization: Bearer TOKEN" metadata (nodes forwarding to owners, the
// embedded client with DialOptions.Token, quotad bench cluster
// --rpc-token), and a node refuses a call without it, Unauthenticated,
// before it reads the call's message.
//
// While a token is rotated, a node accepts several (ServerAuth's list: the
// old and the new) and sends one (Config.Token), so rolling restarts
// never leave a pair of nodes that refuse each other.
//
// The token is a shared secret, not encryption: on an untrusted network,
// run the RPC port over a private network or a mesh with mTLS.

// MinRPCTokenLen is the shortest RPC token a node accepts.
const MinRPCTokenLen = 16

// CheckRPCToken reports what is wrong with a token for --rpc-token ("" is
// none: calls are not checked).
func CheckRPCToken(token string) error {
	if token != "" && len(token) < MinRPCTokenLen {
		return fmt.Errorf("the RPC token (--rpc-token) is %d characters; use at least %d random ones (openssl rand -hex 32)", len(token), MinRPCTokenLen)
	}
	return nil
}

// NodeDialOptions are the dial options for a gRPC client of nodes' RPC
// ports: TLS with tlsConf (TLSFiles.ClientConfig) or plaintext when nil,
// and the cluster's RPC token with every call when token is set. Nodes
// forwarding, the embedded client, quotad bench cluster and the test
// harness all dial with them.
func NodeDialOptions(token string, tlsConf *tls.Config) []grpc.DialOption {
	creds := insecure.NewCredentials()
	if tlsConf != nil {
		creds = dialledName{credentials.NewTLS(tlsConf), tlsConf}
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(creds)}
	if token != "" {
		opts = append(opts, WithRPCToken(token))
	}
	return opts
}

// dialledName hands the address dialled to a TLS config's
// VerifyConnection (TLSFiles' client config checks the node's certificate
// there, against the CA bundle of the moment). crypto/tls passes it
// ConnectionState.ServerName, the SNI, which is empty for an IP address,
// as ring members advertise; crypto/tls's own check uses the address, and
// so does this one.
type dialledName struct {
	credentials.TransportCredentials
	conf *tls.Config
}

func (d dialledName) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	if d.conf.VerifyConnection == nil {
		return d.TransportCredentials.ClientHandshake(ctx, authority, raw)
	}
	name := d.conf.ServerName
	if name == "" {
		// What gRPC's own TLS credentials take as the server name.
		name = authority
		if host, _, err := net.SplitHostPort(authority); err == nil {
			name = host
		}
	}
	return credentials.NewTLS(withDialledName(d.conf, name)).ClientHandshake(ctx, authority, raw)
}

// withDialledName returns a copy of conf whose VerifyConnection sees name
// as the server name when crypto/tls has none (an IP address).
func withDialledName(conf *tls.Config, name string) *tls.Config {
	verify := conf.VerifyConnection
	cfg := conf.Clone()
	cfg.VerifyConnection = func(cs tls.ConnectionState) error {
		if cs.ServerName == "" {
			cs.ServerName = name
		}
		return verify(cs)
	}
	return cfg
}

func (d dialledName) Clone() credentials.TransportCredentials {
	return dialledName{d.TransportCredentials.Clone(), d.conf}
}

// WithRPCToken is the dial option that sends token with every call, for a
// gRPC client of pb.QuotaClient of your own (the embedded client takes
// DialOptions.Token instead).
func WithRPCToken(token string) grpc.DialOption {
	return grpc.WithPerRPCCredentials(rpcToken(token))
}

// rpcToken sends the token with every call (grpc.PerRPCCredentials).
type rpcToken string

func (t rpcToken) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(t)}, nil
}

// RequireTransportSecurity is false: node-to-node RPC is plaintext h2 on a
// private network (see above).
func (rpcToken) RequireTransportSecurity() bool { return false }

// ServerAuth returns the gRPC server options that refuse, Unauthenticated,
// every call that does not carry one of tokens (more than one while a
// token is rotated). No tokens (or only empty ones) return none.
//
// The check is a tap handle (grpc.InTapHandle): it runs when a call's
// headers arrive, before the server reads or decodes its message, so a
// caller without the token costs a node no more than its headers (an
// interceptor runs after the message is decoded, up to the 4 MiB limit).
// It covers every method, unary or streaming, of every service.
func ServerAuth(tokens ...string) []grpc.ServerOption { return ServerAuthNotify(nil, tokens...) }

// ServerAuthNotify is ServerAuth that also tells refused, when it is not
// nil, of each call it refuses: the caller's address (the connection's
// remote address; "" when gRPC does not say) and the refusal (a status
// error, Unauthenticated). A node logs them (rate-limited): a peer with
// another --rpc-token had its calls refused while only the peer's log said
// so. refused runs on the connection's reading goroutine before the
// refusal is sent: it must not block.
func ServerAuthNotify(refused func(remote string, err error), tokens ...string) []grpc.ServerOption {
	tokens = slices.DeleteFunc(slices.Clone(tokens), func(t string) bool { return t == "" })
	if len(tokens) == 0 {
		return nil
	}
	check := tokenCheck(tokens...)
	return []grpc.ServerOption{grpc.InTapHandle(func(ctx context.Context, info *tap.Info) (context.Context, error) {
		err := check(info.Header)
		if err != nil && refused != nil {
			remote := ""
			if p, ok := grpcpeer.FromContext(ctx); ok && p.Addr != nil {
				remote = p.Addr.String()
			}
			refused(remote, err)
		}
		return ctx, err
	})}
}

// CredentialsRefused reports whether err, from a call to a node's RPC port,
// says the node turned the caller's credentials away, or the two sides'
// TLS settings do not fit: its RPC token (Unauthenticated,
// PermissionDenied); its client certificate, or the node's certificate
// that the caller does not trust; TLS on one side only. withTLS is whether
// the caller dialled with TLS. An unreachable node (refused connection,
// timeout) is not a refusal: nothing is known about its credentials.
//
// TLS 1.3 checks the client's certificate after the client's side of the
// handshake is done, so a refusal can reach the client as a connection
// closed under its first write (ExplainTLSMismatch) rather than as the
// alert; with TLS, such a closure counts as a refusal too. A node that
// crashed at that moment looks the same once; its next answer is a
// refused connection.
func CredentialsRefused(err error, withTLS bool) bool {
	switch status.Code(err) {
	case codes.Unauthenticated, codes.PermissionDenied:
		return true
	case codes.Unavailable:
	default:
		return false
	}
	msg := err.Error()
	for _, s := range []string{"remote error: tls:", "x509:", "tls: failed to verify", "authentication handshake failed", "first record does not look like a TLS handshake"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	if withTLS {
		return strings.Contains(msg, "broken pipe") || strings.Contains(msg, "connection reset by peer")
	}
	// A plaintext caller of a node that requires TLS: the node closes the
	// connection before gRPC's preface.
	return strings.Contains(msg, "error reading server preface")
}

// tokenCheck returns what refuses metadata that does not carry one of
// tokens: a status error, Unauthenticated, that says what to set.
func tokenCheck(tokens ...string) func(metadata.MD) error {
	// Hash both sides so the comparison takes the same time whatever the
	// length of the token sent; compare with every accepted token, so the
	// time does not say which one matched.
	wants := make([][sha256.Size]byte, len(tokens))
	for i, t := range tokens {
		wants[i] = sha256.Sum256([]byte(t))
	}
	return func(md metadata.MD) error {
		for _, v := range md.Get("authorization") {
			scheme, got, ok := strings.Cut(v, " ")
			if !ok || !strings.EqualFold(scheme, "Bearer") {
				continue
			}
			sum := sha256.Sum256([]byte(got))
			match := 0
			for _, want := range wants {
				match |= subtle.ConstantTimeCompare(sum[:], want[:])
			}
			if match == 1 {
				return nil
			}
			return status.Error(codes.Unauthenticated, "router: wrong RPC token: use the cluster's --rpc-token (router.DialOptions.Token, QUOTAD_RPC_TOKEN)")
		}
		return status.Error(codes.Unauthenticated, "router: this node requires the cluster's RPC token: set router.DialOptions.Token, or --rpc-token (QUOTAD_RPC_TOKEN)")
	}
}
