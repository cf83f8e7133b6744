package router

import (
	"context"
	"fmt"
	"net"
	"sync"
)

// Faults cuts this node's RPC traffic to chosen addresses, for partition
// tests without root (the gossip side is ring.FaultTransport). It exists only
// for tests: quotad enables it only behind a test flag. Blocked addresses
// refuse new connections, and connections already open fail their next read
// or write, so gRPC reconnects into the block.
type Faults struct {
	mu      sync.Mutex // protects blocked
	blocked map[string]bool
}

// NewFaults makes an empty fault set.
func NewFaults() *Faults { return &Faults{blocked: map[string]bool{}} }

// Block cuts traffic to addrs (host:port).
func (f *Faults) Block(addrs ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, a := range addrs {
		f.blocked[a] = true
	}
}

// Unblock restores traffic to addrs; none means all.
func (f *Faults) Unblock(addrs ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(addrs) == 0 {
		clear(f.blocked)
	}
	for _, a := range addrs {
		delete(f.blocked, a)
	}
}

func (f *Faults) isBlocked(addr string) bool {
	if f == nil {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.blocked[addr]
}

// dial is a gRPC context dialer that honours the blocks.
func (f *Faults) dial(ctx context.Context, addr string) (net.Conn, error) {
	if f.isBlocked(addr) {
		return nil, fmt.Errorf("router: %s is blocked by a test fault", addr)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	return &faultConn{Conn: c, f: f, addr: addr}, nil
}

type faultConn struct {
	net.Conn
	f    *Faults
	addr string
}

func (c *faultConn) Read(b []byte) (int, error) {
	if c.f.isBlocked(c.addr) {
		c.Conn.Close()
		return 0, fmt.Errorf("router: %s is blocked by a test fault", c.addr)
	}
	return c.Conn.Read(b)
}

func (c *faultConn) Write(b []byte) (int, error) {
	if c.f.isBlocked(c.addr) {
		c.Conn.Close()
		return 0, fmt.Errorf("router: %s is blocked by a test fault", c.addr)
	}
	return c.Conn.Write(b)
}
