package faultproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// dialTimeout bounds connecting to the target.
const dialTimeout = 10 * time.Second

// commitReplyWait bounds how long a commit cut waits for the server to
// answer the COMMIT before it closes the connection anyway.
const commitReplyWait = 10 * time.Second

// bufSize is the size of one read, so the largest chunk.
const bufSize = 32 << 10

// Stats counts what a Proxy has done since New.
type Stats struct {
	Accepted   int64 // client connections accepted, refused ones included
	Refused    int64 // closed at once because the proxy was down
	DialErrors int64 // closed because the target could not be reached
	Active     int64 // open now
	BytesUp    int64 // forwarded client to server (counted as the write starts)
	BytesDown  int64 // forwarded server to client (counted as the write starts)
	Cuts       int64 // connections cut by CutAll, SetDown or CutAfterCommit
	CommitCuts int64 // of Cuts, those cut by CutAfterCommit
}

// Proxy forwards TCP connections from its listen address to a target and
// injects faults on command. Its methods are safe for concurrent use.
type Proxy struct {
	ln     net.Listener
	target string
	ctx    context.Context // canceled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // the accept loop and every connection's goroutines

	latency      atomic.Int64 // nanoseconds added per chunk
	commitsToCut atomic.Int64
	// thaw, when set, is closed by SetFrozen(false): until then every chunk
	// waits (SetFrozen).
	thaw atomic.Pointer[chan struct{}]

	accepted, refused, dialErrors atomic.Int64
	bytesUp, bytesDown            atomic.Int64
	cuts, commitCuts              atomic.Int64

	mu     sync.Mutex // protects the following fields
	conns  map[*conn]struct{}
	down   bool
	closed bool
}

// New listens on listen ("127.0.0.1:0" picks a free port) and forwards each
// connection to target (host:port), which is dialled when a client
// connects.
func New(listen, target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, fmt.Errorf("faultproxy: listen: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{
		ln:     ln,
		target: target,
		ctx:    ctx,
		cancel: cancel,
		conns:  make(map[*conn]struct{}),
	}
	p.wg.Add(1)
	go p.acceptLoop()
	return p, nil
}

// Addr is the address clients connect to.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// SetLatency makes every chunk wait d before it is forwarded, in both
// directions; 0 removes the delay. A chunk is what one read returned, so a
// round trip takes at least 2*d more, and a reply that arrives in several
// reads takes d more for each.
func (p *Proxy) SetLatency(d time.Duration) { p.latency.Store(int64(max(d, 0))) }

// SetFrozen(true) holds every chunk read from now on, in both directions,
// until SetFrozen(false), and keeps every connection open: new connections
// are accepted and dialled, and their bytes held too. The client sees a
// server that stopped answering, as a SIGSTOPped Postgres (or one stuck on
// its disk) looks: no error, no reset, nothing. Its own deadlines and
// cancellations are all that end its calls.
func (p *Proxy) SetFrozen(frozen bool) {
	if frozen {
		ch := make(chan struct{})
		p.thaw.CompareAndSwap(nil, &ch)
		return
	}
	if ch := p.thaw.Swap(nil); ch != nil {
		close(*ch)
	}
}

// SetDown(true) cuts every connection and refuses new ones until
// SetDown(false). A refused connection is accepted by the kernel and then
// reset at once, so a client sees "connection reset" or EOF while it starts
// up, not "connection refused".
func (p *Proxy) SetDown(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
	if down {
		p.cutAllLocked()
	}
}

// CutAll closes every current connection, both sides; new ones go through.
func (p *Proxy) CutAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cutAllLocked()
}

// cutAllLocked cuts every connection.
//
// REQUIRES: p.mu held.
func (p *Proxy) cutAllLocked() {
	for c := range p.conns {
		c.close(true /* cut */)
	}
}

// CutAfterCommit arms the next n commits, counted over all connections: when
// a client sends a COMMIT as a simple Query message, the proxy forwards it,
// waits until the server has answered (or commitReplyWait passes), and then
// closes both sides without passing the answer on. The transaction is
// committed; the client gets an error. Calls add up; n <= 0 disarms.
func (p *Proxy) CutAfterCommit(n int) {
	if n <= 0 {
		p.commitsToCut.Store(0)
		return
	}
	p.commitsToCut.Add(int64(n))
}

// takeCommitCut uses up one armed commit cut, if there is one.
func (p *Proxy) takeCommitCut() bool {
	for {
		n := p.commitsToCut.Load()
		if n <= 0 {
			return false
		}
		if p.commitsToCut.CompareAndSwap(n, n-1) {
			return true
		}
	}
}

// Stats returns the counters. They are read one by one, so a snapshot taken
// under traffic need not be consistent across fields.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	active := int64(len(p.conns))
	p.mu.Unlock()
	return Stats{
		Accepted:   p.accepted.Load(),
		Refused:    p.refused.Load(),
		DialErrors: p.dialErrors.Load(),
		Active:     active,
		BytesUp:    p.bytesUp.Load(),
		BytesDown:  p.bytesDown.Load(),
		Cuts:       p.cuts.Load(),
		CommitCuts: p.commitCuts.Load(),
	}
}

// Close stops listening, closes every connection, and returns when all of
// the proxy's goroutines have exited. It is safe to call more than once.
func (p *Proxy) Close() error {
	p.mu.Lock()
	already := p.closed
	p.closed = true
	for c := range p.conns {
		c.close(false)
	}
	p.mu.Unlock()
	if already {
		return nil
	}
	p.cancel()
	err := p.ln.Close()
	p.wg.Wait()
	return err
}

func (p *Proxy) acceptLoop() {
	defer p.wg.Done()
	backoff := 5 * time.Millisecond
	for {
		nc, err := p.ln.Accept()
		if err != nil {
			if p.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors, say: back off and go on.
			t := time.NewTimer(backoff)
			select {
			case <-p.ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		p.accepted.Add(1)

		p.mu.Lock()
		if p.down || p.closed {
			p.mu.Unlock()
			p.refused.Add(1)
			reset(nc)
			continue
		}
		c := p.newConn(nc)
		p.conns[c] = struct{}{}
		// Under p.mu, so it cannot race with Close's wg.Wait: Close sets
		// closed under p.mu first.
		p.wg.Add(1)
		p.mu.Unlock()
		go c.run()
	}
}

// reset closes nc with an RST rather than a FIN, so the client fails at once.
func reset(nc net.Conn) {
	if tc, ok := nc.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = nc.Close()
}

// conn is one proxied connection: a client side, a server side, and a
// goroutine per direction.
type conn struct {
	p      *Proxy
	client net.Conn
	ctx    context.Context // canceled when the connection is closed
	cancel context.CancelFunc
	wire   wireState

	// swallow is set when a commit cut begins: from then on nothing the
	// server sends reaches the client.
	swallow atomic.Bool
	// replied is closed when, while swallowing, the server sends
	// ReadyForQuery: it has finished the COMMIT.
	replied     chan struct{}
	repliedOnce sync.Once

	mu     sync.Mutex // protects the following fields
	server net.Conn   // nil until dialled
	closed bool
}

func (p *Proxy) newConn(nc net.Conn) *conn {
	ctx, cancel := context.WithCancel(p.ctx)
	return &conn{p: p, client: nc, ctx: ctx, cancel: cancel, replied: make(chan struct{})}
}

// close closes both sides, once; cut says whether this is a fault the proxy
// injected (counted in Stats.Cuts) rather than the end of the connection.
func (c *conn) close(cut bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return
	}
	c.closed = true
	if cut {
		c.p.cuts.Add(1)
	}
	c.cancel()
	_ = c.client.Close()
	if c.server != nil {
		_ = c.server.Close()
	}
}

// run dials the target and pumps both directions until both are done.
func (c *conn) run() {
	defer c.p.wg.Done()
	defer func() {
		c.close(false)
		c.p.mu.Lock()
		delete(c.p.conns, c)
		c.p.mu.Unlock()
	}()

	dctx, cancel := context.WithTimeout(c.ctx, dialTimeout)
	var d net.Dialer
	server, err := d.DialContext(dctx, "tcp", c.p.target)
	cancel()
	if err != nil {
		if c.ctx.Err() == nil {
			c.p.dialErrors.Add(1)
			reset(c.client)
		}
		return
	}
	c.mu.Lock()
	if c.closed { // cut while dialling
		c.mu.Unlock()
		_ = server.Close()
		return
	}
	c.server = server
	c.mu.Unlock()

	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		c.clientToServer(server)
	}()
	c.serverToClient(server)
	wg.Wait()
}

// wait blocks for the current latency, and while the proxy is frozen;
// false means the connection closed.
func (c *conn) wait() bool {
	if d := time.Duration(c.p.latency.Load()); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-c.ctx.Done():
			return false
		}
	}
	if thaw := c.p.thaw.Load(); thaw != nil {
		select {
		case <-*thaw:
		case <-c.ctx.Done():
			return false
		}
	}
	return c.ctx.Err() == nil
}

func (c *conn) clientToServer(server net.Conn) {
	fe := newFrontendParser(&c.wire)
	buf := make([]byte, bufSize)
	for {
		n, err := c.client.Read(buf)
		if n > 0 {
			if !c.wait() {
				return
			}
			chunk := buf[:n]
			for off := 0; off < len(chunk); {
				k, commit := fe.advance(chunk[off:])
				off += k
				if commit && c.p.takeCommitCut() {
					c.cutAfterCommit(server, chunk[:off])
					return
				}
			}
			// Counted before the write, so that a client that has seen the
			// bytes' effect also sees them counted.
			c.p.bytesUp.Add(int64(n))
			if _, err := server.Write(chunk); err != nil {
				c.close(false)
				return
			}
		}
		if err != nil {
			c.endDirection(server, err)
			return
		}
	}
}

// cutAfterCommit forwards head, which ends with a COMMIT, and closes the
// connection once the server has answered, without passing the answer on.
// The order matters: swallow is set before the COMMIT goes out, so any
// server bytes read after it (the answer among them) are dropped; and the
// client is cut only after the answer, so when the client sees the error the
// commit is already done.
func (c *conn) cutAfterCommit(server net.Conn, head []byte) {
	c.swallow.Store(true)
	c.p.bytesUp.Add(int64(len(head)))
	if _, err := server.Write(head); err != nil {
		c.close(false)
		return
	}
	t := time.NewTimer(commitReplyWait)
	defer t.Stop()
	select {
	case <-c.replied:
	case <-t.C:
	case <-c.ctx.Done():
	}
	c.p.commitCuts.Add(1)
	c.close(true /* cut */)
}

func (c *conn) serverToClient(server net.Conn) {
	be := backendParser{ws: &c.wire}
	buf := make([]byte, bufSize)
	for {
		n, err := server.Read(buf)
		if n > 0 {
			chunk := buf[:n]
			ready := be.advance(chunk)
			// Checked after the read: if the chunk holds the answer to a
			// COMMIT being cut, it was read after swallow was set.
			if c.swallow.Load() {
				if ready {
					c.repliedOnce.Do(func() { close(c.replied) })
				}
				continue
			}
			if !c.wait() {
				return
			}
			c.p.bytesDown.Add(int64(n))
			if _, err := c.client.Write(chunk); err != nil {
				c.close(false)
				return
			}
		}
		if err != nil {
			c.endDirection(c.client, err)
			return
		}
	}
}

// endDirection ends one direction after a read error: at EOF it passes the
// half-close on to the other side (the opposite direction goes on, as TCP
// allows); after any other error it closes the whole connection.
func (c *conn) endDirection(to net.Conn, err error) {
	if errors.Is(err, io.EOF) {
		if tc, ok := to.(*net.TCPConn); ok {
			if tc.CloseWrite() == nil {
				return
			}
		}
	}
	c.close(false)
}
