package ring

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Rejoin contacts, one by one, every member this node knew that is not
// alive now (for at most ForgetAfter after it stopped being alive), then
// every seed address, skipping itself and alive members, and merges state
// with each (a memberlist push-pull join). It returns how many answered.
// The error is nil when one did or when there was nobody to contact;
// otherwise it joins the resolution and join errors.
//
// The rejoin loop calls it every RejoinInterval: memberlist stops talking to
// a member once it declared it dead and reaped it, so without this the two
// sides of a healed partition would stay apart. Each join is bounded by
// memberlist's TCPTimeout, not by ctx; ctx is checked between targets.
// Former members come first, and need no DNS: the seeds' names were
// resolved first, and a DNS server that did not answer (likely in the
// same outage as the partition) used the whole budget every round, so no
// former member was ever dialled and the partition never healed. Each
// lookup is bounded (lookupTimeout), and the former members' order turns
// every round, so addresses that hang (pods long gone) are not always the
// ones the budget is spent on.
func (r *Ring) Rejoin(ctx context.Context) (int, error) {
	r.lifeMu.RLock()
	err := r.lifeErrLocked()
	r.lifeMu.RUnlock()
	if err != nil {
		return 0, err
	}
	skip := r.rejoinSkip()
	joined := 0
	var errs []error
	try := func(targets []string) error {
		for _, addr := range targets {
			if err := ctx.Err(); err != nil {
				errs = append(errs, err)
				return err
			}
			n, err := r.joinOne(addr)
			if errors.Is(err, ErrClosed) || errors.Is(err, ErrLeft) {
				return err
			}
			joined += n
			if err != nil {
				errs = append(errs, err)
			}
		}
		return nil
	}
	if err := try(r.formerTargets(skip)); errors.Is(err, ErrClosed) || errors.Is(err, ErrLeft) {
		return joined, err
	}
	if ctx.Err() == nil {
		seeds, serrs := r.seedTargets(ctx, skip)
		errs = append(errs, serrs...)
		if err := try(seeds); errors.Is(err, ErrClosed) || errors.Is(err, ErrLeft) {
			return joined, err
		}
	}
	if joined > 0 || len(errs) == 0 {
		return joined, nil
	}
	return 0, errors.Join(errs...)
}

func (r *Ring) joinOne(addr string) (int, error) {
	r.lifeMu.RLock()
	defer r.lifeMu.RUnlock()
	if err := r.lifeErrLocked(); err != nil {
		return 0, err
	}
	n, err := r.ml.Join([]string{addr})
	r.refusalMu.Lock()
	switch {
	case n > 0:
		r.refusal.addr, r.refusal.err = "", nil
	case err != nil && keysDiffer(err):
		r.refusal.addr, r.refusal.err = addr, err
	}
	r.refusalMu.Unlock()
	if err != nil {
		if notGossip(err) {
			return n, fmt.Errorf("join %s: %w (that address answered, but not as a gossip port: --join takes the other nodes' --gossip-addr, 7946 by default, not their HTTP, admin or RPC port)", addr, err)
		}
		return n, fmt.Errorf("join %s: %w", addr, err)
	}
	return n, nil
}

// notGossip reports whether a join failed because the peer answered with
// something that is not memberlist's push-pull (an HTTP or gRPC port given
// to --join): memberlist's "received invalid msgType".
func notGossip(err error) bool {
	return strings.Contains(err.Error(), "received invalid msgType")
}

// keysDiffer reports whether a join failed because the peer answered with
// gossip this node cannot read, or could not read this node's: the gossip
// keys differ, or only one side has any (memberlist's wording).
func keysDiffer(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "no installed keys could decrypt the message") ||
		strings.Contains(msg, "remote state is encrypted and encryption is not configured") ||
		strings.Contains(msg, "encryption is configured but remote state is not encrypted")
}

// Refusal returns the last peer that answered a join of this node but
// could not gossip with it, because the gossip keys differ (SecretKey,
// quotad serve --gossip-key), with memberlist's error; "", nil once a join
// succeeds. A node alone in its ring with a refusal has not found a cluster
// that is free to join, but one it is locked out of: serving alone would
// split the cluster's accounts, so quotad waits instead.
func (r *Ring) Refusal() (addr string, err error) {
	r.refusalMu.Lock()
	defer r.refusalMu.Unlock()
	return r.refusal.addr, r.refusal.err
}

// rejoinTargets lists gossip addresses to contact, as Rejoin does: known
// members that are not alive (formerTargets), then resolved seeds
// (seedTargets), minus this node and alive members.
func (r *Ring) rejoinTargets(ctx context.Context) ([]string, []error) {
	skip := r.rejoinSkip()
	former := r.formerTargets(skip)
	seeds, errs := r.seedTargets(ctx, skip)
	return append(former, seeds...), errs
}

// rejoinSkip is the set of addresses never to contact: this node's and the
// alive members'. formerTargets and seedTargets add what they return.
func (r *Ring) rejoinSkip() map[string]bool {
	snap := r.state.Load()
	skip := map[string]bool{r.Self().GossipAddr: true}
	for _, m := range snap.members {
		skip[m.GossipAddr] = true
	}
	return skip
}

// formerTargets lists the known members that are not alive, in an order
// that turns by one every call, and forgets those not alive for
// ForgetAfter.
func (r *Ring) formerTargets(skip map[string]bool) []string {
	snap := r.state.Load()
	now := r.now()
	r.knownMu.Lock()
	defer r.knownMu.Unlock()
	var names []string
	for name, k := range r.known {
		switch {
		case snap.member(name):
		case now.Sub(k.lastAlive) > r.cfg.ForgetAfter:
			delete(r.known, name)
			r.log.Info("forgetting member", "member", name, "addr", k.addr)
		case k.left:
		default:
			names = append(names, name)
		}
	}
	slices.Sort(names)
	if len(names) > 1 {
		turn := int(r.rejoinTurn % uint64(len(names)))
		names = append(names[turn:], names[:turn]...)
	}
	r.rejoinTurn++
	var targets []string
	for _, name := range names {
		if addr := r.known[name].addr; !skip[addr] {
			skip[addr] = true
			targets = append(targets, addr)
		}
	}
	return targets
}

// lookupTimeout bounds one DNS lookup of a seed's name.
const lookupTimeout = 5 * time.Second

// seedTargets resolves the seeds into gossip addresses not in skip.
func (r *Ring) seedTargets(ctx context.Context, skip map[string]bool) ([]string, []error) {
	var targets []string
	var errs []error
	_, port, _ := net.SplitHostPort(r.Self().GossipAddr)
	defPort, _ := strconv.Atoi(port)
	for _, seed := range r.cfg.Join {
		lctx, cancel := context.WithTimeout(ctx, lookupTimeout)
		addrs, err := r.resolveSeed(lctx, seed, defPort)
		cancel()
		if err != nil {
			errs = append(errs, err)
		}
		for _, a := range addrs {
			if !skip[a] {
				skip[a] = true
				targets = append(targets, a)
			}
		}
	}
	return targets, errs
}

// GoneMember is a member this node knew that is not alive now.
type GoneMember struct {
	ID, GossipAddr string
	// Since is when this node last heard of it (its death or leave, as
	// gossip told it).
	Since time.Time
}

// Gone lists the members this node knew that are not alive now, sorted by
// ID, until ForgetAfter: the status page lists them, since a dead member
// vanished from it with nothing to say it was down.
func (r *Ring) Gone() []GoneMember {
	snap := r.state.Load()
	r.knownMu.Lock()
	defer r.knownMu.Unlock()
	var out []GoneMember
	for name, k := range r.known {
		// NB: by the member's own last event, not the published view
		// alone: between an event and the view built from it a member
		// that just joined read as gone.
		if name != r.cfg.NodeID && k.gone && !snap.member(name) {
			out = append(out, GoneMember{ID: name, GossipAddr: k.addr, Since: k.lastAlive})
		}
	}
	slices.SortFunc(out, func(a, b GoneMember) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// resolveSeed turns a Join entry into gossip addresses: an IP or host with
// an optional port (defPort when absent); a host name stands for all its
// addresses.
func (r *Ring) resolveSeed(ctx context.Context, seed string, defPort int) ([]string, error) {
	host, port, err := splitSeed(seed, defPort)
	if err != nil {
		return nil, err
	}
	if ip := net.ParseIP(host); ip != nil {
		return []string{net.JoinHostPort(ip.String(), port)}, nil
	}
	ips, err := r.resolver.LookupHost(ctx, host)
	if err != nil {
		return nil, fmt.Errorf("resolve %s: %w", host, err)
	}
	out := make([]string, 0, len(ips))
	for _, ip := range ips {
		out = append(out, net.JoinHostPort(ip, port))
	}
	return out, nil
}

// splitSeed splits "host:port", "host", "[v6]:port" or a bare IPv6 address.
func splitSeed(seed string, defPort int) (host, port string, err error) {
	if ip := net.ParseIP(strings.TrimSuffix(strings.TrimPrefix(seed, "["), "]")); ip != nil {
		return ip.String(), strconv.Itoa(defPort), nil
	}
	if !strings.Contains(seed, ":") {
		if !validHostname(seed) {
			return "", "", fmt.Errorf("ring: join address %q: not an IP address or a DNS name (letters, digits, '-', '_' and '.')", seed)
		}
		return seed, strconv.Itoa(defPort), nil
	}
	host, port, err = net.SplitHostPort(seed)
	if err != nil {
		return "", "", fmt.Errorf("ring: join address %q: %w", seed, err)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return "", "", fmt.Errorf("ring: join address %q: port must be 1-65535", seed)
	}
	if host == "" {
		return "", "", fmt.Errorf("ring: join address %q: empty host", seed)
	}
	if net.ParseIP(host) == nil && !validHostname(host) {
		return "", "", fmt.Errorf("ring: join address %q: host %q is not an IP address or a DNS name (letters, digits, '-', '_' and '.')", seed, host)
	}
	return host, port, nil
}

// validHostname reports whether h can be a DNS name: labels of letters,
// digits, '-' and '_' (Kubernetes service names use '-'), separated by
// dots, at most 253 bytes. A typo such as "garbage!!" would otherwise only
// fail to resolve, over and over, while the node serves alone.
func validHostname(h string) bool {
	h = strings.TrimSuffix(h, ".")
	if h == "" || len(h) > 253 {
		return false
	}
	for _, label := range strings.Split(h, ".") {
		if label == "" || len(label) > 63 {
			return false
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}

// joinBudget bounds the join New makes before returning.
func (r *Ring) joinBudget() time.Duration {
	return max(r.cfg.RejoinInterval, 3*r.tcpTimeout)
}

// rejoinLoop calls Rejoin every RejoinInterval until Close. It logs a
// warning when the node is alone and cannot reach anyone, once per episode.
func (r *Ring) rejoinLoop() {
	t := time.NewTicker(r.cfg.RejoinInterval)
	defer t.Stop()
	stranded := false
	for {
		select {
		case <-r.stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), r.joinBudget())
		n, err := r.Rejoin(ctx)
		cancel()
		if errors.Is(err, ErrClosed) || errors.Is(err, ErrLeft) {
			return
		}
		alone := len(r.state.Load().members) <= 1
		switch {
		case err != nil && alone && !stranded:
			stranded = true
			r.log.Warn("alone and cannot reach any seed or former member; still trying. Meanwhile this node owns every account the requests that reach it name "+
				"(quotas stay exact through reservations; rate limits count apart from the other nodes'): check --join (the others' --gossip-addr, "+
				"or a DNS name that resolves to them), that the gossip port (TCP and UDP) is open between the nodes, and --gossip-key", "err", err)
		case err != nil:
			r.log.Debug("rejoin failed", "err", err)
		case n > 0:
			if stranded {
				r.log.Info("reached the cluster again", "contacted", n)
			}
			stranded = false
			r.log.Debug("rejoined", "contacted", n)
		}
	}
}
