package node

import (
	"context"
	"fmt"
	"net"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
)

// Checking the RPC credentials against the serving peers.
//
// A node whose --rpc-token (or RPC certificate) the others refuse could
// still join the ring (gossip has its own key) and take its share of the
// accounts: every charge it forwarded failed, and every charge the others
// forwarded to it too, while it said it was ready (an SRE review: 498
// "500 internal-error" answers in 25 s, nothing in its own log). Before it
// takes accounts, a node now calls each serving peer once (RingView, as a
// forwarded charge goes: its token, its TLS) and waits while any of them
// refuses it, or answers that it has no token while this node requires one
// (router.HeaderRPCAuth: it would send none, and be refused here), saying
// why on /readyz and in its log. A rotation run as
// README says never trips it: each node accepts what every other sends at
// every step. A peer that does not answer at all is no refusal: nothing is
// known of its credentials, and a dead peer must not keep the others from
// serving.

// probeTimeout bounds one probe of one peer.
const probeTimeout = 2 * time.Second

// peerProbe is one serving peer's answer to probePeers.
type peerProbe struct {
	m   ring.Meta
	err error // the refusal; nil when the peer took the call or did not answer
	// tokenless is set when the peer has no token (it sends none) while
	// this node requires one.
	tokenless bool
}

// probePeers calls every serving peer in this node's view and keeps why
// they refuse its calls, or "" (peerRefusal), logging a new reason once.
func (n *Node) probePeers(ctx context.Context) {
	why, first := n.probeRefusal(ctx)
	n.peerAuthMu.Lock()
	prev := n.peerRefusal
	n.peerRefusal = why
	n.peerAuthMu.Unlock()
	switch {
	case why != "" && why != prev && first != nil:
		n.log.Error("other nodes refuse this node's RPC calls: "+why, "err", first)
	case why != "" && why != prev:
		n.log.Error("this node would refuse other nodes' RPC calls: " + why)
	case why == "" && prev != "":
		n.log.Info("the serving nodes take this node's RPC calls now")
	}
}

// peerRefusalReason is what the last probePeers found, or "".
func (n *Node) peerRefusalReason() string {
	n.peerAuthMu.Lock()
	defer n.peerAuthMu.Unlock()
	return n.peerRefusal
}

// probeRefusal probes the serving peers at once and says why they refuse
// this node, or ""; first is the first refusal's error, for the log.
func (n *Node) probeRefusal(ctx context.Context) (why string, first error) {
	if n.Ring() == nil { // NB: stored after n.router (joinRing)
		return "", nil
	}
	probes := atOnce(n.servingPeers(), func(m ring.Meta) peerProbe { return n.probePeer(ctx, m) })
	var token, cert, tokenless []string
	for _, p := range probes {
		name := fmt.Sprintf("%s at %s", p.m.ID, p.m.RPCAddr)
		switch {
		case p.tokenless:
			tokenless = append(tokenless, name)
		case p.err == nil:
			continue
		case isTokenRefusal(p.err):
			token = append(token, name)
		default:
			cert = append(cert, name)
		}
		if first == nil {
			first = p.err
		}
	}
	var whys []string
	if len(token) > 0 {
		// The status message is the peer's own and says which: no token,
		// or another one.
		msg := ""
		for _, p := range probes {
			if p.err != nil && isTokenRefusal(p.err) {
				msg = status.Convert(p.err).Message()
				break
			}
		}
		whys = append(whys, fmt.Sprintf("the serving nodes %s refused this node's RPC token (%q): every charge it forwarded to them, and every one they forwarded to it, would fail; "+
			"give every node the cluster's --rpc-token (QUOTAD_RPC_TOKEN); while rotating it, each node must accept what every other sends (README, \"Rotating\")",
			strings.Join(token, ", "), msg))
	}
	if len(cert) > 0 {
		var cause string
		for _, p := range probes {
			if p.err != nil && !p.tokenless && !isTokenRefusal(p.err) {
				cause = handshakeCause(p.err)
				break
			}
		}
		whys = append(whys, fmt.Sprintf("the TLS handshake with %s failed (%s): %s", strings.Join(cert, ", "), cause, n.handshakeFix(cause)))
	}
	if len(tokenless) > 0 {
		whys = append(whys, fmt.Sprintf("the serving nodes %s have no RPC token, so they send none, while this node requires one (--rpc-token): it would refuse every charge they forward to it; "+
			"give every node the same --rpc-token (QUOTAD_RPC_TOKEN), or none", strings.Join(tokenless, ", ")))
	}
	return strings.Join(whys, "; "), first
}

// handshakeCause is the part of a failed call's error that says why the
// handshake failed (gRPC wraps it in two layers of "desc = ..."), cut to
// a line: /readyz gave one text for every cause, and the log alone the
// real one.
func handshakeCause(err error) string {
	msg := status.Convert(err).Message()
	for _, mark := range []string{"tls: ", "x509: ", "transport: "} {
		if i := strings.Index(msg, mark); i >= 0 {
			msg = msg[i:]
			break
		}
	}
	msg = strings.TrimRight(strings.TrimPrefix(msg, `connection error: desc = "`), `"`)
	// x509 names the time of the check ("current time 2026-...Z is after
	// ..."): it changed every second, and each probe logged the reason anew.
	msg = checkTime.ReplaceAllString(msg, "")
	if len(msg) > 240 {
		msg = msg[:240] + "..."
	}
	return msg
}

// checkTime is x509's "current time T is after|before T" in a validity
// error.
var checkTime = regexp.MustCompile(`: current time \S+ is (after|before) \S+`)

// handshakeFix says what to change for a handshake that failed with cause
// (handshakeCause): the generic advice named neither the side that has no
// TLS nor --rpc-tls-server-name.
func (n *Node) handshakeFix(cause string) string {
	switch {
	case n.rpcTLS.client == nil:
		return "this node has no --rpc-tls-*, and the serving nodes speak TLS: give it the cluster's --rpc-tls-cert, --rpc-tls-key and --rpc-tls-ca (QUOTAD_RPC_TLS_CERT, _KEY, _CA)"
	case strings.Contains(cause, "server preface") || strings.Contains(cause, "first record does not look like a TLS handshake"):
		return "this node speaks TLS (--rpc-tls-*), and the serving nodes do not: give every node the same --rpc-tls-* files, or none"
	case strings.Contains(cause, "certificate is valid for") || strings.Contains(cause, "IP SANs"):
		return "their certificates do not carry the name this node checks (the address dialled, or --rpc-tls-server-name when set): give every node " +
			"--rpc-tls-server-name, one DNS name all their certificates carry, or certificates with their IP addresses"
	case strings.Contains(cause, "expired") || strings.Contains(cause, "not yet valid"):
		return "a certificate is outside its validity dates (or a clock is wrong): renew it; nodes read renewed files without a restart"
	}
	return "give every node certificates from the same CA (--rpc-tls-cert, --rpc-tls-key, --rpc-tls-ca), allowed for client auth, or none"
}

// servingPeers are the other members on the ring (serving) in this node's
// view, with an RPC address to call.
func (n *Node) servingPeers() []ring.Meta {
	r := n.Ring()
	if r == nil {
		return nil
	}
	v := r.View()
	var peers []ring.Meta
	for _, m := range v.Members {
		if m.ID != n.cfg.ID && m.RPCAddr != "" && slices.Contains(v.Serving, m.ID) {
			peers = append(peers, m)
		}
	}
	return peers
}

// atOnce calls ask for every item at once, each on a goroutine of its own
// that ends when ask returns (ask bounds its calls), and returns the
// answers in items' order once all have returned. The node asks its peers
// this way: probes, LedgerStart, RingView after a pause.
func atOnce[E, T any](items []E, ask func(E) T) []T {
	out := make([]T, len(items))
	var wg sync.WaitGroup
	for i, it := range items {
		wg.Go(func() { out[i] = ask(it) })
	}
	wg.Wait()
	return out
}

// probePeer probes one peer with this node's credentials; when this node
// requires a token, the peer's answer also says whether it has one.
func (n *Node) probePeer(ctx context.Context, m ring.Meta) peerProbe {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	tokenless, err := n.router.Probe(ctx, m.RPCAddr)
	switch {
	case err != nil && router.CredentialsRefused(err, n.rpcTLS.client != nil):
		return peerProbe{m: m, err: err}
	case err != nil:
		return peerProbe{m: m} // no answer: nothing known
	}
	return peerProbe{m: m, tokenless: tokenless && n.rpcToken() != ""}
}

// isTokenRefusal reports whether err is a refusal of the RPC token (as
// opposed to one of TLS).
func isTokenRefusal(err error) bool {
	c := status.Code(err)
	return c == codes.Unauthenticated || c == codes.PermissionDenied
}

// rpcRefused hears each call the RPC port refused for its token
// (router.ServerAuthNotify): counted, and logged once per refusedEvery
// with the count held back, naming the caller's address and the members
// on its host.
func (n *Node) rpcRefused(remote string, err error) {
	n.rpcRefusedCalls.Add(1)
	ok, held := n.refusedLog.Allow(time.Now(), refusedEvery)
	if !ok {
		return
	}
	from := remote
	if from == "" {
		from = "an unknown address"
	}
	if ids := n.membersOnHost(remote); len(ids) > 0 {
		from += " (the host of " + strings.Join(ids, ", ") + ")"
	}
	n.log.Error("refused an RPC call from "+from+": "+status.Convert(err).Message()+
		"; a node or embedded client with another --rpc-token (QUOTAD_RPC_TOKEN), or none, cannot forward charges to this node",
		"remote", remote, "similar_lines_held_back", held)
}

// refusedEvery is how often rpcRefused logs at most.
const refusedEvery = 10 * time.Second

// membersOnHost names the ring members other than this node whose RPC
// address is on remote's host.
func (n *Node) membersOnHost(remote string) []string {
	r := n.Ring()
	host, _, err := net.SplitHostPort(remote)
	if r == nil || err != nil {
		return nil
	}
	var ids []string
	for _, m := range r.View().Members {
		if h, _, err := net.SplitHostPort(m.RPCAddr); err == nil && h == host && m.ID != n.cfg.ID {
			ids = append(ids, m.ID)
		}
	}
	return ids
}
