package router_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/peer"

	"github.com/quotaring/quotaring/internal/pki"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/router/pb"
)

// tlsServer accepts TLS connections with cfg on loopback and writes each
// one's handshake result back: "ok" or the error.
func tlsServer(t *testing.T, cfg *tls.Config) string {
	t.Helper()
	lis, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { lis.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := lis.Accept()
			if err != nil {
				return // closed by the cleanup
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				c.SetDeadline(time.Now().Add(5 * time.Second))
				if err := c.(*tls.Conn).Handshake(); err != nil {
					return
				}
				c.Write([]byte("ok"))
			}()
		}
	}()
	return lis.Addr().String()
}

// handshake dials addr with cfg and returns the server's leaf certificate,
// or the error of the handshake or of the first read (with TLS 1.3 a
// server's refusal of the client's certificate arrives there).
func handshake(addr string, cfg *tls.Config) (*x509.Certificate, error) {
	if cfg.VerifyConnection != nil {
		// A TLSFiles client config: hand it the address, as
		// NodeDialOptions does.
		host, _, _ := net.SplitHostPort(addr)
		cfg = router.WithDialledName(cfg, host)
	}
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 2)
	if _, err := c.Read(buf); err != nil {
		return nil, err
	}
	return c.ConnectionState().PeerCertificates[0], nil
}

func writeFile(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// renew writes a newly issued pair over cert and key (a minute ahead in
// mtime, as a rename would give), checks that addr presents it from the
// next handshake on (not prev) and returns it with its PEM.
func renew(t *testing.T, ca *pki.CA, name string, names pki.Names, cert, key, addr string, cli *tls.Config, prev *x509.Certificate) (*x509.Certificate, []byte, []byte) {
	t.Helper()
	certPEM, keyPEM, err := ca.Issue(name, names)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, cert, certPEM)
	writeFile(t, key, keyPEM)
	later := time.Now().Add(time.Minute)
	os.Chtimes(cert, later, later)
	renewed, err := handshake(addr, cli)
	if err != nil {
		t.Fatal(err)
	}
	if renewed.SerialNumber.Cmp(prev.SerialNumber) == 0 {
		t.Fatal("the server still presents the first certificate after it was renewed")
	}
	return renewed, certPEM, keyPEM
}

// TestTLSFilesMutual: a node's config and a client's from files of one CA
// talk; a client with no certificate, or one from another CA, or expecting
// another server name, does not.
func TestTLSFilesMutual(t *testing.T) {
	dir := t.TempDir()
	ca, err := pki.NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	files, err := ca.WriteFiles(dir, "node", pki.Names{DNS: []string{"quotad.internal"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := files.ServerConfig()
	if err != nil {
		t.Fatal(err)
	}
	addr := tlsServer(t, srv)

	for name, sn := range map[string]string{"by IP SAN": "", "by --rpc-tls-server-name": "quotad.internal"} {
		f := files
		f.ServerName = sn
		cli, err := f.ClientConfig()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := handshake(addr, cli); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}

	other, _ := pki.NewCA("another CA")
	otherFiles, err := other.WriteFiles(filepath.Join(dir, "other"), "client", pki.Names{})
	if err != nil {
		t.Fatal(err)
	}
	otherCli, err := otherFiles.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	goodCli, _ := files.ClientConfig()
	noCert := goodCli.Clone()
	noCert.GetClientCertificate = nil
	foreignCert := goodCli.Clone()
	foreignCert.GetClientCertificate = otherCli.GetClientCertificate
	wrongName := goodCli.Clone()
	wrongName.ServerName = "quotad.example"
	for name, tc := range map[string]struct {
		cfg  *tls.Config
		want string
	}{
		"no client certificate":               {noCert, "certificate required"},
		"a client certificate of another CA":  {foreignCert, "unknown certificate authority"},
		"a server certificate not of its CA":  {otherCli, "certificate signed by unknown authority"},
		"a server name the certificate lacks": {wrongName, "quotad.example"},
	} {
		_, err := handshake(addr, tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %q", name, err, tc.want)
		}
	}
}

// TestTLSFilesReload: a renewed certificate is used from the next
// handshake, without a restart; one written half-way keeps the previous.
func TestTLSFilesReload(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.NewCA("test CA")
	ip := pki.Names{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}}
	files, err := ca.WriteFiles(dir, "node", ip)
	if err != nil {
		t.Fatal(err)
	}
	addr, cli, first, reloaded := serveReloading(t, files)

	renewed, _, keyPEM := renew(t, ca, "node", ip, files.Cert, files.Key, addr, cli, first)

	// Half-written: the key truncated. The renewed pair stays.
	later := time.Now().Add(2 * time.Minute)
	writeFile(t, files.Key, keyPEM[:len(keyPEM)/2])
	os.Chtimes(files.Key, later, later)
	kept, err := handshake(addr, cli)
	if err != nil {
		t.Fatalf("a half-written key broke the handshake: %v", err)
	}
	if kept.SerialNumber.Cmp(renewed.SerialNumber) != 0 {
		t.Fatal("the server changed certificate on a pair that does not load")
	}
	reloads := reloaded()
	if len(reloads) != 2 || reloads[0] != nil || reloads[1] == nil {
		t.Fatalf("OnReload heard %v, want nil (renewed) then an error (half-written)", reloads)
	}
	t.Logf("half-written: %v", reloads[1])
}

// serveReloading serves TLS with files' server config on loopback, makes a
// first handshake with its client config, and records what OnReload hears
// (reloaded returns it so far).
func serveReloading(t *testing.T, files router.TLSFiles) (addr string, cli *tls.Config, first *x509.Certificate, reloaded func() []error) {
	t.Helper()
	var mu sync.Mutex
	var reloads []error
	files.OnReload = func(err error) { mu.Lock(); reloads = append(reloads, err); mu.Unlock() }
	srv, cli, err := files.Configs()
	if err != nil {
		t.Fatal(err)
	}
	addr = tlsServer(t, srv)
	if first, err = handshake(addr, cli); err != nil {
		t.Fatal(err)
	}
	return addr, cli, first, func() []error { mu.Lock(); defer mu.Unlock(); return slices.Clone(reloads) }
}

// TestTLSFilesErrors: what a node says at start about files that cannot
// work, naming the file and the fix.
func TestTLSFilesErrors(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.NewCA("test CA")
	good, err := ca.WriteFiles(dir, "node", pki.Names{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	other, _ := pki.NewCA("another CA")
	foreign, _ := other.WriteFiles(filepath.Join(dir, "other"), "node", pki.Names{})
	expired, _ := ca.WriteFiles(filepath.Join(dir, "expired"), "node", pki.Names{NotBefore: time.Now().Add(-48 * time.Hour), NotAfter: time.Now().Add(-time.Hour)})
	serverOnly, _ := ca.WriteFiles(filepath.Join(dir, "serveronly"), "node", pki.Names{Usages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
	notPEM := filepath.Join(dir, "not.pem")
	writeFile(t, notPEM, []byte("hello\n"))

	with := func(mod func(*router.TLSFiles)) router.TLSFiles { f := good; mod(&f); return f }
	for name, tc := range map[string]struct {
		files router.TLSFiles
		want  string
	}{
		"no key":                      {with(func(f *router.TLSFiles) { f.Key = "" }), "missing: [key (--rpc-tls-key)]"},
		"no CA file":                  {with(func(f *router.TLSFiles) { f.CA = filepath.Join(dir, "nope.pem") }), "read the CA bundle"},
		"a CA file without PEM":       {with(func(f *router.TLSFiles) { f.CA = notPEM }), "holds no PEM certificate"},
		"certificate and key swapped": {with(func(f *router.TLSFiles) { f.Cert, f.Key = f.Key, f.Cert }), "swapped"},
		"a key of another pair":       {with(func(f *router.TLSFiles) { f.Key = foreign.Key }), "private key does not match public key"},
		"a certificate of another CA": {with(func(f *router.TLSFiles) { f.Cert, f.Key = foreign.Cert, foreign.Key }), "unknown authority"},
		"an expired certificate":      {with(func(f *router.TLSFiles) { f.Cert, f.Key = expired.Cert, expired.Key }), "expired"},
		"a server-only certificate":   {with(func(f *router.TLSFiles) { f.Cert, f.Key = serverOnly.Cert, serverOnly.Key }), "not valid as a client certificate"},
	} {
		_, err := tc.files.ServerConfig()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %q", name, err, tc.want)
			continue
		}
		// The hint on extended key usages is for errors of key usage only:
		// it was given for an expired certificate, one of another CA.
		if usage := strings.Contains(tc.want, "not valid as a"); usage != strings.Contains(err.Error(), "extended key usages") {
			t.Errorf("%s: %v: the hint on extended key usages, want it only for a usage error", name, err)
		}
		if errors.Is(err, os.ErrNotExist) && !strings.Contains(err.Error(), "nope.pem") {
			t.Errorf("%s: %v does not name the file", name, err)
		}
	}
}

// TestTLSFilesSelfName: a node's certificate must carry the name the
// other nodes check it against (--rpc-tls-server-name, or else the host it
// advertises), at start and at each renewal. One without it was taken: the
// node went ready, and every other node failed to forward to it.
func TestTLSFilesSelfName(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.NewCA("test CA")
	byIP, err := ca.WriteFiles(filepath.Join(dir, "ip"), "node", pki.Names{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	byName, _ := ca.WriteFiles(filepath.Join(dir, "dns"), "node", pki.Names{DNS: []string{"quotad.internal"}})
	with := func(f router.TLSFiles, self, server string) router.TLSFiles {
		f.SelfHost, f.ServerName = self, server
		return f
	}
	for name, tc := range map[string]struct {
		files router.TLSFiles
		want  string // "" for no error
	}{
		"the advertised IP":                    {with(byIP, "127.0.0.1", ""), ""},
		"another advertised IP":                {with(byIP, "127.0.0.2", ""), "does not carry the name 127.0.0.2 (the host this node advertises for RPC"},
		"a DNS name, no --rpc-tls-server-name": {with(byName, "127.0.0.1", ""), "does not carry the name 127.0.0.1"},
		"the server name":                      {with(byName, "127.0.0.1", "quotad.internal"), ""},
		"another server name":                  {with(byName, "127.0.0.1", "other.internal"), "does not carry the name other.internal (--rpc-tls-server-name"},
		"an IP, with a server name":            {with(byIP, "127.0.0.1", "quotad.internal"), "does not carry the name quotad.internal"},
		"an embedded client's":                 {with(byName, "", ""), ""},
	} {
		_, err := tc.files.ServerConfig()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v, want it taken", name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v, want an error saying %q", name, err, tc.want)
		}
	}

	// A renewal without the name keeps the previous pair, and says why.
	files := with(byIP, "127.0.0.1", "")
	addr, cli, first, reloaded := serveReloading(t, files)
	certPEM, keyPEM, err := ca.Issue("node", pki.Names{DNS: []string{"quotad.internal"}})
	if err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Minute)
	for path, b := range map[string][]byte{files.Cert: certPEM, files.Key: keyPEM} {
		writeFile(t, path, b)
		os.Chtimes(path, later, later)
	}
	kept, err := handshake(addr, cli)
	if err != nil || kept.SerialNumber.Cmp(first.SerialNumber) != 0 {
		t.Fatalf("after a renewal without the name: %v, want the first certificate kept", err)
	}
	if reloads := reloaded(); len(reloads) != 1 || reloads[0] == nil || !strings.Contains(reloads[0].Error(), "does not carry the name 127.0.0.1") {
		t.Fatalf("OnReload heard %v, want the missing name", reloads)
	}
}

// echoQuota answers Charge batches with one empty reply per charge: the
// transport is what BenchmarkRPCTransport measures, not the engine.
type echoQuota struct{ pb.UnimplementedQuotaServer }

func (echoQuota) Charge(_ context.Context, b *pb.ChargeBatch) (*pb.ChargeReplies, error) {
	return &pb.ChargeReplies{Replies: make([]*pb.ChargeReply, len(b.Charges))}, nil
}

// BenchmarkRPCTransport: one internal Charge call of one charge over
// loopback, plaintext h2 against mutual TLS 1.3 (connections made once, as
// nodes keep them), one caller and many.
func BenchmarkRPCTransport(b *testing.B) {
	dir := b.TempDir()
	ca, _ := pki.NewCA("bench CA")
	files, err := ca.WriteFiles(dir, "node", pki.Names{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		b.Fatal(err)
	}
	srvTLS, cliTLS, err := files.Configs()
	if err != nil {
		b.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		srv  []grpc.ServerOption
	}{
		{name: "plaintext"},
		{name: "mtls", srv: []grpc.ServerOption{grpc.Creds(credentials.NewTLS(srvTLS))}},
	} {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		s := grpc.NewServer(tc.srv...)
		pb.RegisterQuotaServer(s, echoQuota{})
		go s.Serve(lis)
		dial := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
		if tc.name == "mtls" {
			dial = router.NodeDialOptions("", cliTLS)
		}
		conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), dial...)
		if err != nil {
			b.Fatal(err)
		}
		c := pb.NewQuotaClient(conn)
		batch := &pb.ChargeBatch{Charges: []*pb.ChargeRequest{{Account: "acct-1", Units: 1, Route: "GET /x"}}}
		if _, err := c.Charge(context.Background(), batch); err != nil {
			b.Fatalf("%s: %v", tc.name, err)
		}
		b.Run(tc.name+"/1", func(b *testing.B) {
			for b.Loop() {
				if _, err := c.Charge(context.Background(), batch); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(tc.name+"/64", func(b *testing.B) {
			b.SetParallelism(32) // 64 callers on 2 cores
			b.RunParallel(func(p *testing.PB) {
				for p.Next() {
					if _, err := c.Charge(context.Background(), batch); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
		conn.Close()
		s.Stop()
	}
}

// TestCertFiles: an HTTPS port's pair (--http-tls-*, --admin-tls-*) serves
// clients that trust its CA, is read again when renewed, keeps the previous
// pair when the new one does not load, and files that cannot work are
// refused at start, naming the flag or the file.
func TestCertFiles(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.NewCA("public CA")
	ip := pki.Names{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}, Usages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	good, err := ca.WriteFiles(dir, "front", ip)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var reloads []error
	files := router.CertFiles{Cert: good.Cert, Key: good.Key, OnReload: func(err error) { mu.Lock(); reloads = append(reloads, err); mu.Unlock() }}
	srv, err := files.ServerConfig("--http-tls")
	if err != nil {
		t.Fatal(err)
	}
	if srv.ClientAuth != tls.NoClientCert {
		t.Fatalf("ClientAuth %v: a public port must not ask clients for certificates", srv.ClientAuth)
	}
	addr := tlsServer(t, srv)
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca.PEM)
	cli := &tls.Config{RootCAs: roots}
	first, err := handshake(addr, cli)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := handshake(addr, &tls.Config{}); err == nil || !strings.Contains(err.Error(), "unknown authority") {
		t.Fatalf("a client that does not trust the CA: %v, want unknown authority", err)
	}

	renewed, certPEM, _ := renew(t, ca, "front", ip, files.Cert, files.Key, addr, cli, first)
	later := time.Now().Add(2 * time.Minute)
	writeFile(t, files.Cert, certPEM[:len(certPEM)/2])
	os.Chtimes(files.Cert, later, later)
	if kept, err := handshake(addr, cli); err != nil || kept.SerialNumber.Cmp(renewed.SerialNumber) != 0 {
		t.Fatalf("a half-written certificate: %v; want the renewed pair kept", err)
	}
	mu.Lock()
	if len(reloads) != 2 || reloads[0] != nil || reloads[1] == nil {
		t.Fatalf("OnReload heard %v, want nil (renewed) then an error (half-written)", reloads)
	}
	mu.Unlock()

	expired, _ := ca.WriteFiles(filepath.Join(dir, "expired"), "front", pki.Names{NotBefore: time.Now().Add(-48 * time.Hour), NotAfter: time.Now().Add(-time.Hour)})
	early, _ := ca.WriteFiles(filepath.Join(dir, "early"), "front", pki.Names{NotBefore: time.Now().Add(time.Hour), NotAfter: time.Now().Add(48 * time.Hour)})
	other, _ := pki.NewCA("another CA")
	foreign, _ := other.WriteFiles(filepath.Join(dir, "other"), "front", pki.Names{})
	for name, tc := range map[string]struct {
		files router.CertFiles
		want  string
	}{
		"no key":                      {router.CertFiles{Cert: good.Cert}, "a certificate without its key; give --http-tls-key too"},
		"no certificate":              {router.CertFiles{Key: good.Key}, "a key without its certificate; give --http-tls-cert too"},
		"no such file":                {router.CertFiles{Cert: filepath.Join(dir, "nope.pem"), Key: good.Key}, "nope.pem"},
		"certificate and key swapped": {router.CertFiles{Cert: expired.Key, Key: expired.Cert}, "swapped"},
		"a key of another pair":       {router.CertFiles{Cert: expired.Cert, Key: foreign.Key}, "private key does not match public key"},
		"an expired certificate":      {router.CertFiles{Cert: expired.Cert, Key: expired.Key}, "not now: every client would refuse it; renew it"},
		"a certificate not valid yet": {router.CertFiles{Cert: early.Cert, Key: early.Key}, "not now"},
	} {
		_, err := tc.files.ServerConfig("--http-tls")
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "--http-tls") {
			t.Errorf("%s: %v, want an error naming --http-tls and saying %q", name, err, tc.want)
		}
	}
}

// ExplainTLSMismatch adds which side to change to the transport errors of a
// TLS mismatch, and leaves other errors alone.
func TestExplainTLSMismatch(t *testing.T) {
	for _, tc := range []struct {
		err     string
		withTLS bool
		want    string
	}{
		{`connection error: desc = "error reading server preface: EOF"`, false, "dial with TLS"},
		{`connection error: desc = "error reading server preface: EOF"`, false, "its gossip port, --gossip-addr"},
		{`connection error: desc = "error reading server preface: http2: frame too large"`, false, "it is likely a node's gossip port, --gossip-addr"},
		{`authentication handshake failed: tls: first record does not look like a TLS handshake`, true, "the node does not speak TLS"},
		{`authentication handshake failed: tls: first record does not look like a TLS handshake`, true, "its gossip port, --gossip-addr"},
		{`write tcp 127.0.0.1:1->127.0.0.1:2: write: broken pipe`, true, "it likely refused this client's certificate"},
		{`read tcp 127.0.0.1:1->127.0.0.1:2: read: connection reset by peer`, true, "it likely refused this client's certificate"},
		{`write tcp 127.0.0.1:1->127.0.0.1:2: write: broken pipe`, false, ""},
		{`context deadline exceeded`, true, ""},
	} {
		got := router.ExplainTLSMismatch(errors.New(tc.err), tc.withTLS).Error()
		if tc.want == "" && got != tc.err || tc.want != "" && !strings.Contains(got, tc.want) {
			t.Errorf("%q (TLS %v): %q, want %q", tc.err, tc.withTLS, got, tc.want)
		}
	}
}

// TestTLSFilesCARotation: a CA rotates on running nodes with no restart,
// over gRPC as nodes dial each other: both CAs in every bundle, then
// certificates of the new CA, then the new CA alone, each step used from
// the next handshake on. A step out of order (a bundle the node's own
// certificate does not chain to) keeps the previous set, and says so.
func TestTLSFilesCARotation(t *testing.T) {
	dir := t.TempDir()
	oldCA, _ := pki.NewCA("old CA")
	newCA, _ := pki.NewCA("new CA")
	ip := pki.Names{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}}
	node, err := oldCA.WriteFiles(filepath.Join(dir, "node"), "node", ip)
	if err != nil {
		t.Fatal(err)
	}
	client, err := oldCA.WriteFiles(filepath.Join(dir, "client"), "client", ip)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var reloads []error
	node.OnReload = func(err error) { mu.Lock(); reloads = append(reloads, err); mu.Unlock() }
	lastReload := func() (int, error) {
		mu.Lock()
		defer mu.Unlock()
		if len(reloads) == 0 {
			return 0, nil
		}
		return len(reloads), reloads[len(reloads)-1]
	}
	srvTLS, _, err := node.Configs()
	if err != nil {
		t.Fatal(err)
	}
	cliTLS, err := client.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(grpc.Creds(credentials.NewTLS(srvTLS)))
	pb.RegisterQuotaServer(s, echoQuota{})
	go s.Serve(lis)
	t.Cleanup(s.Stop)

	// call makes a new connection (a new handshake) and returns the issuer
	// of the certificate the node presented.
	call := func(cfg *tls.Config) (string, error) {
		conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), router.NodeDialOptions("", cfg)...)
		if err != nil {
			return "", err
		}
		defer conn.Close()
		var p peer.Peer
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		_, err = pb.NewQuotaClient(conn).Charge(ctx, &pb.ChargeBatch{Charges: []*pb.ChargeRequest{{Account: "acct-1", Units: 1}}}, grpc.Peer(&p))
		if err != nil {
			return "", err
		}
		return p.AuthInfo.(credentials.TLSInfo).State.PeerCertificates[0].Issuer.CommonName, nil
	}
	// write puts b in path, its mtime a step later than the last write's,
	// as a rename by cert-manager would.
	step := 0
	write := func(path string, b []byte) {
		t.Helper()
		writeFile(t, path, b)
		step++
		later := time.Now().Add(time.Duration(step) * time.Minute)
		if err := os.Chtimes(path, later, later); err != nil {
			t.Fatal(err)
		}
	}
	reissue := func(ca *pki.CA, f router.TLSFiles, name string) {
		t.Helper()
		certPEM, keyPEM, err := ca.Issue(name, ip)
		if err != nil {
			t.Fatal(err)
		}
		write(f.Key, keyPEM)
		write(f.Cert, certPEM)
	}
	wantIssuer := func(what, want string) {
		t.Helper()
		got, err := call(cliTLS)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got != want {
			t.Fatalf("%s: the node presents a certificate of %q, want %q", what, got, want)
		}
	}

	wantIssuer("at start", "old CA")
	both := append(append([]byte{}, oldCA.PEM...), newCA.PEM...)
	write(node.CA, both)
	write(client.CA, both)
	wantIssuer("both CAs in the bundles", "old CA")
	reissue(newCA, node, "node")
	wantIssuer("the node on a certificate of the new CA, the client still on the old", "new CA")
	reissue(newCA, client, "client")
	wantIssuer("both on certificates of the new CA", "new CA")
	write(node.CA, newCA.PEM)
	write(client.CA, newCA.PEM)
	wantIssuer("the new CA alone", "new CA")
	if n, err := lastReload(); n == 0 || err != nil {
		t.Fatalf("after the rotation OnReload heard %d readings, the last %v; want the last nil", n, err)
	}

	// A client still on the old CA's certificate is refused now, and a
	// client that trusts the old CA alone refuses the node.
	stale, err := oldCA.WriteFiles(filepath.Join(dir, "stale"), "stale", ip)
	if err != nil {
		t.Fatal(err)
	}
	staleBoth := stale
	staleBoth.CA = filepath.Join(dir, "stale", "both.pem")
	writeFile(t, staleBoth.CA, both)
	for what, f := range map[string]router.TLSFiles{"a client certificate of the retired CA": staleBoth, "a client trusting the retired CA alone": stale} {
		cfg, err := f.ClientConfig()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := call(cfg); err == nil {
			t.Errorf("%s: the call went through", what)
		}
	}

	// Out of order: a bundle of a third CA, which the node's certificate
	// does not chain to. The node keeps the new CA, and says why.
	third, _ := pki.NewCA("third CA")
	write(node.CA, third.PEM)
	wantIssuer("after a bundle the node's certificate does not chain to", "new CA")
	if _, err := lastReload(); err == nil || !strings.Contains(err.Error(), "unknown authority") {
		t.Fatalf("OnReload heard %v, want why the bundle was not taken (unknown authority)", err)
	}
}
