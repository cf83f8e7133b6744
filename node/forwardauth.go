package node

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
)

// Peers that refuse this node's forwards once it serves.
//
// probePeers (peerauth.go) checks the credentials before a node takes
// accounts. Once it serves, the peers can start refusing it: their
// --rpc-token was rotated (they accept only the new one) and this node's
// was not, or their CA changed. It then stayed ready while every charge it
// forwarded failed. Now each forwarded call's outcome is heard
// (router.Config.OnForward): a peer that has refused this node's
// credentials (router.CredentialsRefused) at least minForwardRefusals times
// over at least forwardRefusedFor (its latest refusal that long after its
// first), with no answer in between, is refusing it, and while a majority
// of the serving peers is, /readyz answers 503 naming them and the flag to
// check. The refusing peers are probed every
// forwardProbeEvery (no traffic reaches a node that is not ready), and one
// answer from a peer clears it. A peer that does not answer (down,
// Unavailable), or answers with any other error, says nothing of the
// credentials and changes nothing; so does one burst of refusals however
// many (a TLS peer that crashes resets every call in flight to it, which
// looks like a refusal each, and then its port is closed: the refusals
// stop). One peer alone refusing in a larger cluster does not unready this
// node: that peer is the odd one (its own --rpc-token is not the
// cluster's), and it would unready every other node.

// minForwardRefusals and forwardRefusedFor make a peer's refusals
// persistent (see above).
const (
	minForwardRefusals = 3
	forwardRefusedFor  = 3 * time.Second
)

// forwardProbeEvery is how often the peers that refuse this node are
// probed again.
const forwardProbeEvery = time.Second

// forwardAuth tracks, per peer RPC address, the refusals of this node's
// forwarded calls since the peer last answered one. It is the pure part:
// the caller passes the time. Safe for concurrent use.
type forwardAuth struct {
	// some is true while peers may be non-empty: an answered call (every
	// forward, on the charge path) then takes no lock when it is false.
	some  atomic.Bool
	mu    sync.Mutex // protects peers
	peers map[string]*peerRefusals
}

// peerRefusals are one peer's refusals since its last answer.
type peerRefusals struct {
	since  time.Time // the first of them
	latest time.Time // the latest of them
	n      int
	last   error
}

// heard records one call's outcome: refused says the peer refused this
// node's credentials (router.CredentialsRefused).
func (f *forwardAuth) heard(addr string, err error, refused bool, now time.Time) {
	if err == nil && !f.some.Load() {
		return // NB: nothing to clear; the common case
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	defer func() { f.some.Store(len(f.peers) > 0) }()
	switch {
	case err == nil:
		delete(f.peers, addr)
	case refused:
		if f.peers == nil {
			f.peers = make(map[string]*peerRefusals)
		}
		p := f.peers[addr]
		if p == nil {
			p = &peerRefusals{since: now}
			f.peers[addr] = p
		}
		p.n++
		p.latest = now
		p.last = err
	}
}

// refusing returns the serving peers whose refusals are persistent (at
// least minForwardRefusals, the latest forwardRefusedFor or more after the
// first), with the last refusal of each, and forgets the addresses that are
// no serving peer's any more. A peer that refuses for real goes on refusing
// the probes (reprobeRefusing), so its refusals spread over time; the
// burst of a crashed TLS peer does not.
func (f *forwardAuth) refusing(serving []ring.Meta) (peers []ring.Meta, errs []error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	known := make(map[string]bool, len(serving))
	for _, m := range serving {
		known[m.RPCAddr] = true
		if p := f.peers[m.RPCAddr]; p != nil && p.n >= minForwardRefusals && p.latest.Sub(p.since) >= forwardRefusedFor {
			peers = append(peers, m)
			errs = append(errs, p.last)
		}
	}
	for addr := range f.peers {
		if !known[addr] {
			delete(f.peers, addr)
		}
	}
	f.some.Store(len(f.peers) > 0)
	return peers, errs
}

// suspects lists the addresses with refusals recorded, persistent or not.
func (f *forwardAuth) suspects() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	addrs := make([]string, 0, len(f.peers))
	for addr := range f.peers {
		addrs = append(addrs, addr)
	}
	return addrs
}

// forwardRefusalWhy says why this node is not ready when a majority of
// serving peers refuse its credentials persistently, or "".
func forwardRefusalWhy(serving, refusing []ring.Meta, errs []error) string {
	if len(refusing) == 0 || 2*len(refusing) <= len(serving) {
		return ""
	}
	var token, cert []string
	for i, m := range refusing {
		name := fmt.Sprintf("%s at %s", m.ID, m.RPCAddr)
		if isTokenRefusal(errs[i]) {
			token = append(token, name)
		} else {
			cert = append(cert, name)
		}
	}
	var whys []string
	if len(token) > 0 {
		whys = append(whys, fmt.Sprintf("the serving nodes %s refuse the RPC token this node forwards charges with (%d of %d serving peers, for %s or more): "+
			"their --rpc-token was changed and this node's was not; give it the cluster's --rpc-token (QUOTAD_RPC_TOKEN) and restart it; "+
			"while rotating, each node must accept what every other sends (README, \"Rotating\")",
			strings.Join(token, ", "), len(refusing), len(serving), forwardRefusedFor))
	}
	if len(cert) > 0 {
		whys = append(whys, fmt.Sprintf("the TLS handshake with the serving nodes %s fails for the charges this node forwards (%d of %d serving peers, for %s or more): "+
			"give every node certificates from the same CA (--rpc-tls-cert, --rpc-tls-key, --rpc-tls-ca), allowed for client auth",
			strings.Join(cert, ", "), len(refusing), len(serving), forwardRefusedFor))
	}
	return strings.Join(whys, "; ")
}

// onForward hears each forwarded call (router.Config.OnForward).
func (n *Node) onForward(addr string, err error) {
	var now time.Time
	if err != nil {
		now = time.Now() // NB: only a refusal needs it; answered calls are the charge path
	}
	n.fwdAuth.heard(addr, err, err != nil && router.CredentialsRefused(err, n.rpcTLS.client != nil), now)
}

// forwardRefusal is why this serving node is not ready because its peers
// refuse its forwards, or "" (forwardRefusalWhy). A new reason is logged
// at ERROR once, and its end at INFO.
func (n *Node) forwardRefusal() string {
	serving := n.servingPeers()
	refusing, errs := n.fwdAuth.refusing(serving)
	why := forwardRefusalWhy(serving, refusing, errs)
	n.peerAuthMu.Lock()
	prev := n.fwdRefusal
	n.fwdRefusal = why
	n.peerAuthMu.Unlock()
	switch {
	case why != "" && why != prev:
		n.log.Error("other nodes refuse the charges this node forwards; /readyz answers 503 until they take them: "+why, "err", errs[0])
	case why == "" && prev != "":
		n.log.Info("the serving nodes take the charges this node forwards again")
	}
	return why
}

// reprobeRefusing probes, every forwardProbeEvery, the peers that refused
// a forwarded call since they last answered one, feeding the outcome back:
// a node that is not ready gets no traffic to forward, so without this it
// could not learn that its peers take its calls again. It ends with ctx.
func (n *Node) reprobeRefusing(ctx context.Context) {
	t := time.NewTicker(forwardProbeEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		atOnce(n.fwdAuth.suspects(), func(addr string) struct{} { // within probeTimeout
			pctx, cancel := context.WithTimeout(ctx, probeTimeout)
			defer cancel()
			_, err := n.router.Probe(pctx, addr)
			n.onForward(addr, err)
			return struct{}{}
		})
		n.forwardRefusal() // logs a change even while nobody asks /readyz
	}
}
