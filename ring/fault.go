package ring

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
)

// FaultTransport wraps a memberlist.Transport and cuts traffic to and from
// chosen peers, so tests can partition nodes that share one machine without
// root or network namespaces.
//
// It exists only for tests: it changes the stream wire format (below), so
// every node of a cluster must use it or none; quotad creates it only behind
// a test flag. Faults are off until Block is called.
//
// What a block on peer address A (its advertised gossip host:port) does:
//
//   - packets to A are dropped, as a lossy network would (WriteTo succeeds);
//   - packets from A are dropped (a UDP packet's source is A's gossip socket);
//   - dials to A fail at once;
//   - streams from A are closed on arrival.
//
// A TCP stream's source port is ephemeral, so on one IP the receiver cannot
// tell who dialed. Each FaultTransport therefore starts every stream it
// dials with a preamble naming its own advertised address:
//
//	+------+-----+---------------------+
//	| 0xF0 | len | addr (len bytes)    |
//	+------+-----+---------------------+
//
// and strips it from every stream it accepts (a stream without it is passed
// through, so a FaultTransport accepts plain memberlist peers, but a plain
// peer cannot accept a FaultTransport's streams). 0xF0 is not a memberlist
// message type.
type FaultTransport struct {
	inner   memberlist.Transport
	packets chan *memberlist.Packet
	streams chan net.Conn
	closing chan struct{} // Shutdown started: hand nothing more to memberlist
	done    chan struct{} // inner is shut down: forwarders return
	wg      sync.WaitGroup

	shutdownOnce sync.Once
	shutdownErr  error

	// protects blocked and self
	mu      sync.Mutex
	blocked map[string]bool // canonical host:port
	self    string          // our advertised address, sent in the preamble

	droppedPackets atomic.Int64
	droppedStreams atomic.Int64
}

var _ memberlist.NodeAwareTransport = (*FaultTransport)(nil)

const (
	faultPreambleMagic   = 0xF0
	faultPreambleTimeout = 2 * time.Second
)

// NewFaultTransport wraps inner and starts forwarding its traffic. The
// FaultTransport owns inner: its Shutdown shuts inner down.
func NewFaultTransport(inner memberlist.Transport) *FaultTransport {
	t := &FaultTransport{
		inner:   inner,
		packets: make(chan *memberlist.Packet),
		streams: make(chan net.Conn),
		closing: make(chan struct{}),
		done:    make(chan struct{}),
		blocked: make(map[string]bool),
	}
	t.wg.Add(2)
	go t.forwardPackets()
	go t.forwardStreams()
	return t
}

// NewFaultNetTransport listens on bindAddr:bindPort (0 picks a free port)
// with memberlist's NetTransport and wraps it. logger may be nil.
func NewFaultNetTransport(bindAddr string, bindPort int, logger *slog.Logger) (*FaultTransport, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	nc := &memberlist.NetTransportConfig{
		BindAddrs: []string{bindAddr},
		BindPort:  bindPort,
		Logger:    newStdLogger(logger.With("subsystem", "memberlist")),
	}
	// NB: with port 0 the kernel picks a free TCP port, and the UDP port of
	// the same number can be taken; memberlist retries the same way.
	var err error
	for range 10 {
		var nt *memberlist.NetTransport
		if nt, err = memberlist.NewNetTransport(nc); err == nil {
			return NewFaultTransport(nt), nil
		}
		if bindPort != 0 || !strings.Contains(err.Error(), "address already in use") {
			break
		}
	}
	return nil, fmt.Errorf("ring: fault transport: %w", err)
}

// Block cuts traffic to and from each peer address (host:port, an IP).
func (t *FaultTransport) Block(addrs ...string) error {
	keys, err := canonicalAddrs(addrs)
	if err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, k := range keys {
		t.blocked[k] = true
	}
	return nil
}

// Unblock restores traffic with each peer address.
func (t *FaultTransport) Unblock(addrs ...string) error {
	keys, err := canonicalAddrs(addrs)
	if err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, k := range keys {
		delete(t.blocked, k)
	}
	return nil
}

// UnblockAll restores traffic with every peer.
func (t *FaultTransport) UnblockAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	clear(t.blocked)
}

// Blocked returns the blocked peer addresses, sorted.
func (t *FaultTransport) Blocked() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]string, 0, len(t.blocked))
	for k := range t.blocked {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// Dropped returns how many packets and streams (dialed or accepted) were cut.
func (t *FaultTransport) Dropped() (packets, streams int64) {
	return t.droppedPackets.Load(), t.droppedStreams.Load()
}

func canonicalAddrs(addrs []string) ([]string, error) {
	keys := make([]string, 0, len(addrs))
	for _, a := range addrs {
		ap, err := netip.ParseAddrPort(a)
		if err != nil {
			return nil, fmt.Errorf("ring: fault: peer address %q: want ip:port: %w", a, err)
		}
		keys = append(keys, canonical(ap))
	}
	return keys, nil
}

func canonical(ap netip.AddrPort) string {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()).String()
}

func (t *FaultTransport) isBlocked(addr string) bool {
	key := addr
	if ap, err := netip.ParseAddrPort(addr); err == nil {
		key = canonical(ap)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.blocked[key]
}

// FinalAdvertiseAddr implements memberlist.Transport and records the
// address this transport announces in its preamble.
func (t *FaultTransport) FinalAdvertiseAddr(ip string, port int) (net.IP, int, error) {
	aip, aport, err := t.inner.FinalAdvertiseAddr(ip, port)
	if err != nil {
		return nil, 0, err
	}
	self := net.JoinHostPort(aip.String(), fmt.Sprint(aport))
	if ap, perr := netip.ParseAddrPort(self); perr == nil {
		self = canonical(ap)
	}
	t.mu.Lock()
	t.self = self
	t.mu.Unlock()
	return aip, aport, nil
}

// WriteTo implements memberlist.Transport.
func (t *FaultTransport) WriteTo(b []byte, addr string) (time.Time, error) {
	return t.WriteToAddress(b, memberlist.Address{Addr: addr})
}

// WriteToAddress implements memberlist.NodeAwareTransport.
func (t *FaultTransport) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	if t.isBlocked(a.Addr) {
		t.droppedPackets.Add(1)
		return time.Now(), nil
	}
	if na, ok := t.inner.(memberlist.NodeAwareTransport); ok {
		return na.WriteToAddress(b, a)
	}
	return t.inner.WriteTo(b, a.Addr)
}

// PacketCh implements memberlist.Transport.
func (t *FaultTransport) PacketCh() <-chan *memberlist.Packet { return t.packets }

// StreamCh implements memberlist.Transport.
func (t *FaultTransport) StreamCh() <-chan net.Conn { return t.streams }

// DialTimeout implements memberlist.Transport.
func (t *FaultTransport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	return t.DialAddressTimeout(memberlist.Address{Addr: addr}, timeout)
}

// DialAddressTimeout implements memberlist.NodeAwareTransport: it refuses
// blocked peers and writes the preamble.
func (t *FaultTransport) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	if t.isBlocked(a.Addr) {
		t.droppedStreams.Add(1)
		return nil, fmt.Errorf("ring: fault: %s is blocked", a.Addr)
	}
	var conn net.Conn
	var err error
	if na, ok := t.inner.(memberlist.NodeAwareTransport); ok {
		conn, err = na.DialAddressTimeout(a, timeout)
	} else {
		conn, err = t.inner.DialTimeout(a.Addr, timeout)
	}
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	self := t.self
	t.mu.Unlock()
	pre := append([]byte{faultPreambleMagic, byte(len(self))}, self...)
	_ = conn.SetWriteDeadline(time.Now().Add(faultPreambleTimeout))
	if _, err := conn.Write(pre); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("ring: fault: write preamble: %w", err)
	}
	_ = conn.SetWriteDeadline(time.Time{})
	return conn, nil
}

// Shutdown implements memberlist.Transport: it shuts inner down and waits
// for the forwarding goroutines.
func (t *FaultTransport) Shutdown() error {
	t.shutdownOnce.Do(func() {
		close(t.closing)
		// The forwarders keep draining inner while it shuts down: inner's
		// listeners may be blocked handing it a packet or a connection.
		t.shutdownErr = t.inner.Shutdown()
		close(t.done)
		t.wg.Wait()
	})
	return t.shutdownErr
}

func (t *FaultTransport) forwardPackets() {
	defer t.wg.Done()
	in := t.inner.PacketCh()
	for {
		select {
		case p := <-in:
			if p.From != nil && t.isBlocked(p.From.String()) {
				t.droppedPackets.Add(1)
				continue
			}
			select {
			case t.packets <- p:
			case <-t.closing:
			}
		case <-t.done:
			return
		}
	}
}

func (t *FaultTransport) forwardStreams() {
	defer t.wg.Done()
	in := t.inner.StreamCh()
	for {
		select {
		case c := <-in:
			t.wg.Add(1)
			go t.admit(c)
		case <-t.done:
			return
		}
	}
}

// admit reads an accepted stream's preamble and hands the stream to
// memberlist unless its sender is blocked.
func (t *FaultTransport) admit(c net.Conn) {
	defer t.wg.Done()
	_ = c.SetReadDeadline(time.Now().Add(faultPreambleTimeout))
	from, conn, err := readPreamble(c)
	_ = c.SetReadDeadline(time.Time{})
	if err != nil {
		_ = c.Close()
		return
	}
	if from != "" && t.isBlocked(from) {
		t.droppedStreams.Add(1)
		_ = c.Close()
		return
	}
	select {
	case t.streams <- conn:
	case <-t.closing:
		_ = c.Close()
	}
}

// readPreamble returns the sender's address, or "" and a conn that replays
// the byte it read when the stream has no preamble.
func readPreamble(c net.Conn) (string, net.Conn, error) {
	var b [1]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return "", nil, err
	}
	if b[0] != faultPreambleMagic {
		return "", &replayConn{Conn: c, first: []byte{b[0]}}, nil
	}
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return "", nil, err
	}
	addr := make([]byte, b[0])
	if _, err := io.ReadFull(c, addr); err != nil {
		return "", nil, err
	}
	// An empty address (a dial before memberlist asked for the advertise
	// address) leaves the stream unattributed.
	return string(addr), c, nil
}

// replayConn returns first before the rest of Conn.
type replayConn struct {
	net.Conn
	first []byte
}

func (c *replayConn) Read(p []byte) (int, error) {
	if len(c.first) > 0 {
		n := copy(p, c.first)
		c.first = c.first[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}
