// Package cluster runs real quotad processes on loopback for tests, the
// chaos harness and quotad demo: each node its own process, data dir and
// 127.0.0.x address, all sharing one ledger.
//
//	bin, _ := cluster.Build(ctx, dir)            // go build ./cmd/quotad
//	c, _ := cluster.Start(ctx, cluster.Options{Binary: bin, Nodes: 3, Ledger: dsn, Dir: dir})
//	defer c.Stop(ctx)
//	c.WaitConverged(ctx)                          // all ready, one ring
//	c.Nodes[1].Kill()                             // SIGKILL, for real
//	c.Nodes[1].Start(ctx)                         // same data dir
package cluster

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"

	"github.com/quotaring/quotaring/internal/pki"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/router/pb"
)

// Build compiles quotad into dir and returns the binary's path. The binary is
// built without the race detector (in-process tests run with it; several
// race-instrumented nodes would crowd two cores) unless
// QUOTARING_BUILD_RACE=1.
func Build(ctx context.Context, dir string) (string, error) {
	root, err := moduleRoot()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "quotad")
	args := []string{"build", "-o", bin}
	if os.Getenv("QUOTARING_BUILD_RACE") == "1" {
		args = append(args, "-race")
	}
	cmd := exec.CommandContext(ctx, "go", append(args, "./cmd/quotad")...)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("cluster: go build ./cmd/quotad: %v\n%s", err, out)
	}
	return bin, nil
}

func moduleRoot() (string, error) {
	_, file, _, _ := runtime.Caller(0)
	dir := filepath.Dir(file)
	for d := dir; d != "/" && d != "."; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d, nil
		}
	}
	return "", fmt.Errorf("cluster: no go.mod above %s", dir)
}

// Options describe a cluster.
type Options struct {
	Binary string // quotad to run (Build)
	Nodes  int
	Ledger string // DSN or SQLite path every node uses
	Dir    string // data dirs and logs go under it
	// Args are extra flags for every node (e.g. --upstream ...).
	Args []string
	// TestFaults passes --test-faults (partition and clock faults).
	TestFaults bool
	// SettleInterval is passed as --settle-interval (default 200ms).
	SettleInterval time.Duration
	// FirstIP is the first loopback address's last byte (default 10):
	// node i listens on Subnet.(FirstIP+i).
	FirstIP int
	// Subnet is the first three bytes of the nodes' loopback addresses
	// (default "127.0.0"). Clusters that may run at the same time on one
	// machine take different ones: a node that rejoins its last known
	// members by address could otherwise meet another cluster's node that
	// took a port of the same address.
	Subnet string
	// GossipKey (base64) and RPCToken, when set, lock the cluster's
	// internal ports (quotad serve --gossip-key, --rpc-token). They reach
	// the nodes through the environment (QUOTAD_GOSSIP_KEY,
	// QUOTAD_RPC_TOKEN), as the README advises, and Node.Dial sends the
	// token.
	GossipKey, RPCToken string
	// RPCTLS, when set, runs the internal RPC over mutual TLS (quotad serve
	// --rpc-tls-*, through QUOTAD_RPC_TLS_*); Node.Dial then dials with
	// its client side. NewTLS makes one.
	RPCTLS router.TLSFiles
	// AdminToken, when set, turns the admin API on (quotad serve
	// --admin-token, through QUOTAD_ADMIN_TOKEN); Node.AdminGet and
	// AdminPost send it, as /debug/ and /test/ then ask for it too.
	AdminToken string
}

// TLSServerName is the name NewTLS's node certificate carries (and its
// files' ServerName): one name for every node, as --rpc-tls-server-name.
const TLSServerName = "quotad.internal"

// NewTLS makes a throwaway CA under dir and one certificate every node of
// a local cluster shares, for Options.RPCTLS; client is the side for the
// program's own connections (Conns.TLS, router.DialOptions.TLS).
func NewTLS(dir string) (files router.TLSFiles, client *tls.Config, err error) {
	ca, err := pki.NewCA("quotaring local cluster CA")
	if err != nil {
		return files, nil, err
	}
	if files, err = ca.WriteFiles(dir, "node", pki.Names{DNS: []string{TLSServerName}}); err != nil {
		return files, nil, fmt.Errorf("cluster: write the TLS files: %w", err)
	}
	files.ServerName = TLSServerName
	if client, err = files.ClientConfig(); err != nil {
		return files, nil, err
	}
	return files, client, nil
}

// NewSecrets returns a fresh gossip key (base64 of 32 random bytes) and
// RPC token for Options.GossipKey and Options.RPCToken.
func NewSecrets() (gossipKey, rpcToken string) {
	key := make([]byte, 32)
	crand.Read(key)
	return base64.StdEncoding.EncodeToString(key), crand.Text()
}

// Cluster is a set of quotad processes.
type Cluster struct {
	opts Options
	mu   sync.Mutex // protects Nodes while AddNode may append (read with List)
	// Nodes are the cluster's nodes, in the order they were added. Code that
	// runs beside AddNode (a load generator) reads List instead.
	Nodes []*Node
}

// List is a copy of Nodes, safe while another goroutine calls AddNode.
func (c *Cluster) List() []*Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*Node(nil), c.Nodes...)
}

// Node is one quotad process.
type Node struct {
	ID                       string
	IP                       string
	DataDir                  string
	RPC, HTTP, Admin, Gossip string
	LogPath                  string
	args                     []string
	env                      []string // added to the process's environment
	rpcToken                 string
	adminToken               string
	tls                      *tls.Config // client side, with Options.RPCTLS
	bin                      string
	mu                       sync.Mutex // protects cmd, exited and exitErr
	cmd                      *exec.Cmd
	exited                   chan struct{}
	exitErr                  error
	logFile                  *os.File
}

// Start launches the nodes: the first alone, the others joining it.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	if opts.Nodes <= 0 || opts.Binary == "" || opts.Ledger == "" || opts.Dir == "" {
		return nil, errors.New("cluster: Options need Binary, Nodes, Ledger and Dir")
	}
	if opts.SettleInterval == 0 {
		opts.SettleInterval = 200 * time.Millisecond
	}
	if opts.FirstIP == 0 {
		opts.FirstIP = 10
	}
	if opts.Subnet == "" {
		opts.Subnet = "127.0.0"
	}
	c := &Cluster{opts: opts}
	for i := 0; i < opts.Nodes; i++ {
		n, err := c.newNode(i)
		if err != nil {
			c.Stop(ctx)
			return nil, err
		}
		if err := n.Start(ctx); err != nil {
			c.Stop(ctx)
			return nil, err
		}
		c.Nodes = append(c.Nodes, n)
		if i == 0 {
			if err := n.WaitReady(ctx); err != nil {
				c.Stop(ctx)
				return nil, err
			}
		}
	}
	return c, nil
}

// AddNode starts one more node joining the cluster (scale up).
func (c *Cluster) AddNode(ctx context.Context) (*Node, error) {
	n, err := c.newNode(len(c.Nodes))
	if err != nil {
		return nil, err
	}
	if err := n.Start(ctx); err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.Nodes = append(c.Nodes, n)
	c.mu.Unlock()
	return n, nil
}

func (c *Cluster) newNode(i int) (*Node, error) {
	ip := fmt.Sprintf("%s.%d", c.opts.Subnet, c.opts.FirstIP+i)
	ports, err := freePorts(ip, 4)
	if err != nil {
		return nil, err
	}
	id := fmt.Sprintf("n%d", i+1)
	n := &Node{ID: id, IP: ip, DataDir: filepath.Join(c.opts.Dir, id), LogPath: filepath.Join(c.opts.Dir, id+".log"),
		RPC: hostPort(ip, ports[0]), HTTP: hostPort(ip, ports[1]), Admin: hostPort(ip, ports[2]), Gossip: hostPort(ip, ports[3]), bin: c.opts.Binary}
	n.args = []string{"serve", "--node-id", id, "--data-dir", n.DataDir, "--ledger", c.opts.Ledger,
		"--rpc-addr", n.RPC, "--http-addr", n.HTTP, "--admin-addr", n.Admin, "--gossip-addr", n.Gossip,
		"--ring-preset", "local", "--settle-interval", c.opts.SettleInterval.String(), "--log-format", "json", "--log-level", "debug"}
	if i > 0 || len(c.Nodes) > 0 {
		var seeds []string
		for _, o := range c.Nodes {
			seeds = append(seeds, o.Gossip)
		}
		if len(seeds) == 0 {
			seeds = []string{c.Nodes[0].Gossip}
		}
		n.args = append(n.args, "--join", strings.Join(seeds, ","))
	}
	if c.opts.TestFaults {
		n.args = append(n.args, "--test-faults")
	}
	if c.opts.GossipKey != "" {
		n.env = append(n.env, "QUOTAD_GOSSIP_KEY="+c.opts.GossipKey)
	}
	if c.opts.RPCToken != "" {
		n.env, n.rpcToken = append(n.env, "QUOTAD_RPC_TOKEN="+c.opts.RPCToken), c.opts.RPCToken
	}
	if c.opts.AdminToken != "" {
		n.env, n.adminToken = append(n.env, "QUOTAD_ADMIN_TOKEN="+c.opts.AdminToken), c.opts.AdminToken
	}
	if f := c.opts.RPCTLS; f.Enabled() {
		n.env = append(n.env, "QUOTAD_RPC_TLS_CERT="+f.Cert, "QUOTAD_RPC_TLS_KEY="+f.Key, "QUOTAD_RPC_TLS_CA="+f.CA,
			"QUOTAD_RPC_TLS_SERVER_NAME="+f.ServerName)
		if n.tls, err = f.ClientConfig(); err != nil {
			return nil, err
		}
	}
	n.args = append(n.args, c.opts.Args...)
	return n, nil
}

func hostPort(ip string, port int) string { return net.JoinHostPort(ip, fmt.Sprint(port)) }

// freePorts finds n free TCP ports on ip (that are also free for UDP, which
// gossip needs).
func freePorts(ip string, n int) ([]int, error) {
	var ports []int
	var open []io.Closer
	defer func() {
		for _, c := range open {
			c.Close()
		}
	}()
	for len(ports) < n {
		l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
		if err != nil {
			return nil, fmt.Errorf("cluster: no free port on %s: %w", ip, err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		u, err := net.ListenPacket("udp", net.JoinHostPort(ip, fmt.Sprint(port)))
		if err != nil {
			l.Close()
			continue
		}
		open = append(open, l, u)
		ports = append(ports, port)
	}
	return ports, nil
}

// Start starts (or restarts) the node's process with its data dir.
func (n *Node) Start(ctx context.Context) error { return n.start(nil) }

// StartWithClockOffset starts the node's process with its wall clock
// shifted by d from the start, as if its machine's clock were off (needs
// Options.TestFaults); the next Start is without.
func (n *Node) StartWithClockOffset(ctx context.Context, d time.Duration) error {
	return n.start([]string{"QUOTAD_TEST_CLOCK_OFFSET=" + d.String()})
}

func (n *Node) start(env []string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd != nil && !n.isExitedLocked() {
		return fmt.Errorf("cluster: node %s is running", n.ID)
	}
	f, err := os.OpenFile(n.LogPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(n.bin, n.args...)
	cmd.Env = append(append(nodeEnviron(os.Environ()), n.env...), env...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // never outlive the test
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("cluster: start node %s: %w", n.ID, err)
	}
	n.cmd, n.logFile, n.exited = cmd, f, make(chan struct{})
	exited := n.exited
	go func() {
		err := cmd.Wait()
		n.mu.Lock()
		n.exitErr = err
		n.mu.Unlock()
		f.Close()
		close(exited)
	}()
	return nil
}

func (n *Node) isExitedLocked() bool {
	select {
	case <-n.exited:
		return true
	default:
		return false
	}
}

// Running reports whether the process runs.
func (n *Node) Running() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.cmd != nil && !n.isExitedLocked()
}

// PID is the process id (0 when not running).
func (n *Node) PID() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd == nil || n.isExitedLocked() {
		return 0
	}
	return n.cmd.Process.Pid
}

func (n *Node) signal(sig syscall.Signal) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd == nil {
		return fmt.Errorf("cluster: node %s is not running", n.ID)
	}
	if n.isExitedLocked() {
		// How it ended: a node found dead when it was to be resumed said
		// only "not running", which left a kill from outside the run
		// (signal: killed) and a crash (exit status 2) alike.
		how := "exit status 0"
		if n.exitErr != nil {
			how = n.exitErr.Error()
		}
		return fmt.Errorf("cluster: node %s is not running (it ended: %s)", n.ID, how)
	}
	return n.cmd.Process.Signal(sig)
}

// Kill sends SIGKILL and waits for the process to be gone.
func (n *Node) Kill() error {
	if err := n.signal(syscall.SIGKILL); err != nil {
		return err
	}
	_, err := n.Wait(context.Background())
	return nil_or(err)
}

func nil_or(err error) error {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return nil // killed: an exit error is the point
	}
	return err
}

// Pause sends SIGSTOP; Resume SIGCONT.
func (n *Node) Pause() error  { return n.signal(syscall.SIGSTOP) }
func (n *Node) Resume() error { return n.signal(syscall.SIGCONT) }

// Terminate sends SIGTERM and waits for the exit, returning the exit code.
func (n *Node) Terminate(ctx context.Context) (int, error) {
	if err := n.signal(syscall.SIGTERM); err != nil {
		return -1, err
	}
	return n.Wait(ctx)
}

// Wait waits for the process to exit and returns its exit code.
func (n *Node) Wait(ctx context.Context) (int, error) {
	n.mu.Lock()
	exited := n.exited
	n.mu.Unlock()
	if exited == nil {
		return -1, fmt.Errorf("cluster: node %s never started", n.ID)
	}
	select {
	case <-exited:
	case <-ctx.Done():
		return -1, ctx.Err()
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.exitErr == nil {
		return 0, nil
	}
	var ee *exec.ExitError
	if errors.As(n.exitErr, &ee) {
		return ee.ExitCode(), n.exitErr
	}
	return -1, n.exitErr
}

// WaitReady polls /readyz until it answers 200 or ctx ends.
func (n *Node) WaitReady(ctx context.Context) error {
	return Poll(ctx, 50*time.Millisecond, func() (bool, error) {
		if !n.Running() {
			return false, fmt.Errorf("cluster: node %s exited; its log %s ends:\n%s", n.ID, n.LogPath, n.LogTail(30))
		}
		code, _, err := n.AdminGet(ctx, "/readyz")
		return err == nil && code == http.StatusOK, nil
	})
}

// WaitAlive polls /healthz until it answers 200 or ctx ends: the process
// serves its admin port (and its test faults), ready or not.
func (n *Node) WaitAlive(ctx context.Context) error {
	return Poll(ctx, 50*time.Millisecond, func() (bool, error) {
		if !n.Running() {
			return false, fmt.Errorf("cluster: node %s exited; its log %s ends:\n%s", n.ID, n.LogPath, n.LogTail(30))
		}
		code, _, err := n.AdminGet(ctx, "/healthz")
		return err == nil && code == http.StatusOK, nil
	})
}

// AdminGet GETs a path on the node's admin port.
func (n *Node) AdminGet(ctx context.Context, path string) (int, string, error) {
	return httpDo(ctx, http.MethodGet, "http://"+n.Admin+path, n.adminToken)
}

// AdminPost POSTs to a path on the node's admin port.
func (n *Node) AdminPost(ctx context.Context, path string) (int, string, error) {
	return httpDo(ctx, http.MethodPost, "http://"+n.Admin+path, n.adminToken)
}

// httpDo sends a request without a body, with token as its bearer token
// when set.
func httpDo(ctx context.Context, method, url, token string) (int, string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, method, url, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), nil
}

// LogTail returns the last lines of the node's log.
func (n *Node) LogTail(lines int) string {
	b, _ := os.ReadFile(n.LogPath)
	parts := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(parts) > lines {
		parts = parts[len(parts)-lines:]
	}
	return string(bytes.Join(parts, []byte("\n")))
}

// Dial opens a gRPC connection to the node's RPC address.
func (n *Node) Dial() (*grpc.ClientConn, pb.QuotaClient, error) {
	conn, err := grpc.NewClient("passthrough:///"+n.RPC, router.NodeDialOptions(n.rpcToken, n.tls)...)
	if err != nil {
		return nil, nil, err
	}
	return conn, pb.NewQuotaClient(conn), nil
}

// WaitConverged waits until every running node is ready and all report the
// same ring epoch with every running node serving.
func (c *Cluster) WaitConverged(ctx context.Context) error {
	return Poll(ctx, 100*time.Millisecond, func() (bool, error) {
		var epoch uint64
		running := 0
		for _, n := range c.Nodes {
			if !n.Running() {
				continue
			}
			running++
			if code, _, err := n.AdminGet(ctx, "/readyz"); err != nil || code != http.StatusOK {
				return false, nil
			}
			v, err := n.RingView(ctx)
			if err != nil {
				return false, nil
			}
			serving := 0
			for _, m := range v.Members {
				if m.State == "serving" {
					serving++
				}
			}
			if epoch == 0 {
				epoch = v.Epoch
			}
			if v.Epoch != epoch || serving != c.running() {
				return false, nil
			}
		}
		return running > 0, nil
	})
}

func (c *Cluster) running() int {
	k := 0
	for _, n := range c.Nodes {
		if n.Running() {
			k++
		}
	}
	return k
}

// RingView asks the node for its view of the ring.
func (n *Node) RingView(ctx context.Context) (*pb.RingViewReply, error) {
	conn, cl, err := n.Dial()
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return cl.RingView(ctx, &pb.RingViewRequest{})
}

// Exit is how a node's process ended when the cluster stopped it.
type Exit struct {
	Node *Node
	Code int // 0: drained and settled
	Err  error
	// Killed: it had not exited within stopTimeout and got SIGKILL.
	Killed bool
}

// stopTimeout is how long Stop waits for a node after SIGTERM: a node's own
// shutdown budget (drain 10 s, final settle 20 s, 10 s more) and a little.
const stopTimeout = 45 * time.Second

// Stop terminates every running node at once (SIGTERM, then SIGKILL after
// stopTimeout) and says how each one ended.
func (c *Cluster) Stop(ctx context.Context) []Exit {
	var wg sync.WaitGroup
	var mu sync.Mutex // protects exits
	var exits []Exit
	for _, n := range c.Nodes {
		if !n.Running() {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			tctx, cancel := context.WithTimeout(ctx, stopTimeout)
			defer cancel()
			e := Exit{Node: n}
			if e.Code, e.Err = n.Terminate(tctx); errors.Is(e.Err, context.DeadlineExceeded) {
				e.Killed = true
				n.Kill()
			}
			mu.Lock()
			exits = append(exits, e)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return exits
}

// Poll calls cond every interval until it is true or returns an error, or
// ctx ends (the deadline is the caller's): for conditions nothing announces,
// such as a node's readiness or metrics.
func Poll(ctx context.Context, every time.Duration, cond func() (bool, error)) error {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster: condition not met: %w", ctx.Err())
		case <-t.C:
		}
	}
}

// nodeEnviron is environ without its QUOTAD_* variables: a node of the
// harness is configured by its flags and the harness's own variables only.
// An operator's shell that exports QUOTAD_ADMIN_TOKEN for quotad admin
// gave every chaos node an admin token, and the fault injection (/test/...,
// which then asks for it) answered 401.
func nodeEnviron(environ []string) []string {
	out := make([]string, 0, len(environ))
	for _, kv := range environ {
		if !strings.HasPrefix(kv, "QUOTAD_") {
			out = append(out, kv)
		}
	}
	return out
}
