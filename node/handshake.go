package node

import (
	"errors"
	"io"
	"net"
	"strings"
	"time"

	"google.golang.org/grpc/credentials"
)

// Refused TLS handshakes on the RPC port. A caller refused for its token
// is counted and logged (rpcRefused); one refused at the handshake (a
// certificate of another CA, none at all, plaintext against TLS) left no
// trace on this node: gRPC's server logs handshake errors to its own
// logger, which quotad does not install.

// handshakeNotify wraps a server's transport credentials: each failed
// handshake calls failed with the caller's address and the error.
type handshakeNotify struct {
	credentials.TransportCredentials
	failed func(remote string, err error)
}

func (h handshakeNotify) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	c, info, err := h.TransportCredentials.ServerHandshake(conn)
	if err != nil {
		h.failed(conn.RemoteAddr().String(), err)
	}
	return c, info, err
}

func (h handshakeNotify) Clone() credentials.TransportCredentials {
	return handshakeNotify{h.TransportCredentials.Clone(), h.failed}
}

// rpcHandshakeFailed counts a failed handshake on the RPC port and logs it
// at most once per refusedEvery, with the count held back. A connection
// closed before it said anything (a TCP probe, a port scan's connect) is
// no refusal: not counted.
func (n *Node) rpcHandshakeFailed(remote string, err error) {
	var ne net.Error
	if errors.Is(err, io.EOF) || strings.HasSuffix(err.Error(), "EOF") || errors.As(err, &ne) && ne.Timeout() {
		return // a connection that said nothing, or nothing in time (gRPC's handshake deadline)
	}
	n.rpcHandshakeFailures.Add(1)
	ok, held := n.handshakeLog.Allow(time.Now(), refusedEvery)
	if !ok {
		return
	}
	from := remote
	if ids := n.membersOnHost(remote); len(ids) > 0 {
		from += " (the host of " + strings.Join(ids, ", ") + ")"
	}
	why := "; a node or embedded client without a certificate of this cluster's CA (--rpc-tls-ca), or without TLS, cannot reach this node"
	if strings.Contains(err.Error(), "remote error: ") {
		// The caller's TLS alert: it refused this node's certificate
		// (expired, of another CA, without the name it checks).
		why = "; the caller refused this node's certificate (--rpc-tls-cert): check its dates, CA and names against what the caller trusts and checks"
	}
	n.log.Error("refused a TLS handshake on the RPC port from "+from+": "+err.Error()+why,
		"remote", remote, "similar_lines_held_back", held)
}
