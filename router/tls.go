package router

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"
)

// TLS on the internal RPC.
//
// The RPC token proves a caller knows the cluster's secret, but travels in
// the clear, as do the charges, account ids and config snapshots. With
// TLSFiles every internal connection is mutual TLS: a node presents its
// certificate to the nodes and clients that dial it, and requires theirs,
// each chaining to the cluster's CA. A caller without a certificate from
// that CA does not get past the handshake; with the token as well, it must
// hold both.
//
// The files are PEM, as cert-manager and `openssl` write them. All three
// are read again when any of them changes (checked at each handshake;
// connections live long, so that is rare), as one set: a renewed
// certificate, or a new CA bundle, is used without a restart, and a set
// that does not load or whose certificate does not chain to its bundle (a
// rotation caught half-written, or a step taken out of order) keeps the
// previous one. A CA rotates with no restart: the old and the new CA in one
// bundle on every node, then certificates of the new CA, then the new CA
// alone.
//
// The bundle is applied at every handshake, not baked into the configs:
// the server's comes from GetConfigForClient, and the client verifies the
// node's certificate itself in VerifyConnection (crypto/tls has no hook
// for a client's roots), with the checks crypto/tls makes: the chain to the
// bundle, for server use, and the name dialled (or ServerName).

// TLSFiles names the PEM files of a node's (or an embedded client's) mutual
// TLS on the internal RPC. All three are required.
type TLSFiles struct {
	// Cert is the certificate chain presented to peers, leaf first; Key its
	// private key. The leaf serves both as server and as client certificate:
	// its extended key usages must allow both, or be absent.
	Cert, Key string
	// CA is the bundle the peers' certificates must chain to.
	CA string
	// ServerName is the name a node's certificate must carry. Empty: the
	// host of the address dialled (ring members advertise IPs, so their
	// certificates need IP SANs); set it to one DNS name every node's
	// certificate carries (say quotad.internal) to verify against that
	// instead.
	ServerName string
	// SelfHost, for a node, is the host its RPC address advertises: with
	// no ServerName the other nodes check its certificate against it. A
	// node's certificate must carry the name the others check (ServerName,
	// or else SelfHost), at the first reading and at each renewal: one
	// without it was taken, the node went ready and took accounts whose
	// charges every other node then failed to forward. Empty (an embedded
	// client, whose certificate is a client's only): not checked.
	SelfHost string
	// OnReload, when set, hears of every reading of the files after the
	// first (one of them changed): nil when the new set is in use, else why
	// the previous one stays.
	OnReload func(error)
}

// Enabled reports whether any file is named.
func (f TLSFiles) Enabled() bool { return f.Cert != "" || f.Key != "" || f.CA != "" }

// selfName is the name a node's own certificate must carry (see SelfHost),
// and where it comes from; "" for an embedded client.
func (f TLSFiles) selfName() (name, from string) {
	switch {
	case f.SelfHost == "":
		return "", ""
	case f.ServerName != "":
		return f.ServerName, "--rpc-tls-server-name, which the other nodes check it against"
	}
	return f.SelfHost, "the host this node advertises for RPC (--advertise-host, or --rpc-addr's), which the other nodes check it against with no --rpc-tls-server-name"
}

// ServerConfig loads the files and returns the TLS config of a node's RPC
// port: it presents Cert and requires a client certificate chaining to CA.
func (f TLSFiles) ServerConfig() (*tls.Config, error) {
	server, _, err := f.Configs()
	return server, err
}

// ClientConfig loads the files and returns the TLS config for dialling
// nodes (DialOptions.TLS, Config.TLS): it verifies the node's certificate
// against CA (and ServerName) and presents Cert.
func (f TLSFiles) ClientConfig() (*tls.Config, error) {
	_, client, err := f.Configs()
	return client, err
}

// Configs returns both of a node's configs, sharing one reading of the
// files (so a change is read, and OnReload told, once).
func (f TLSFiles) Configs() (server, client *tls.Config, err error) {
	kp, err := f.load()
	if err != nil {
		return nil, nil, err
	}
	getCert := func() (*tls.Certificate, error) { pair, _ := kp.get(); return pair, nil }
	server = &tls.Config{
		MinVersion: tls.VersionTLS13,
		// The RPC port speaks gRPC: the per-handshake config must offer h2
		// itself, as gRPC's credentials add it to this one only.
		NextProtos: []string{"h2"},
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			pair, roots := kp.get()
			return &tls.Config{
				MinVersion:   tls.VersionTLS13,
				NextProtos:   []string{"h2"},
				Certificates: []tls.Certificate{*pair},
				ClientAuth:   tls.RequireAndVerifyClientCert,
				ClientCAs:    roots,
			}, nil
		},
	}
	client = &tls.Config{
		MinVersion: tls.VersionTLS13,
		ServerName: f.ServerName,
		// Verified in VerifyConnection against the bundle of the moment,
		// with every check crypto/tls would make (see the top of the file).
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, roots := kp.get()
			if f.ServerName != "" {
				cs.ServerName = f.ServerName
			}
			return verifyServer(cs, roots)
		},
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return getCert() },
	}
	return server, client, nil
}

// verifyServer checks a node's certificate as crypto/tls does for a
// client: it chains to roots, for server use, and carries the name dialled,
// cs.ServerName. crypto/tls leaves that empty when the name is an IP
// address (no SNI is sent for one), so NodeDialOptions fills it in from the
// address dialled; TLSFiles.ServerName, when set, takes its place.
func verifyServer(cs tls.ConnectionState, roots *x509.CertPool) error {
	if len(cs.PeerCertificates) == 0 {
		return errors.New("tls: the node presented no certificate")
	}
	if cs.ServerName == "" {
		return errors.New("router: RPC TLS: no name to check the node's certificate against: dial with router.NodeDialOptions (it passes the address dialled), or set TLSFiles.ServerName")
	}
	opts := x509.VerifyOptions{Roots: roots, DNSName: cs.ServerName, Intermediates: x509.NewCertPool(),
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	for _, c := range cs.PeerCertificates[1:] {
		opts.Intermediates.AddCert(c)
	}
	if _, err := cs.PeerCertificates[0].Verify(opts); err != nil {
		return &tls.CertificateVerificationError{UnverifiedCertificates: cs.PeerCertificates, Err: err}
	}
	return nil
}

func (f TLSFiles) load() (*keyPair, error) {
	var missing []string
	for _, x := range []struct{ name, path string }{{"certificate (--rpc-tls-cert)", f.Cert}, {"key (--rpc-tls-key)", f.Key}, {"CA bundle (--rpc-tls-ca)", f.CA}} {
		if x.path == "" {
			missing = append(missing, x.name)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("router: RPC TLS needs a certificate, its key and the CA bundle; missing: %v", missing)
	}
	kp := &keyPair{label: "RPC TLS", cert: f.Cert, key: f.Key, ca: f.CA, onReload: f.OnReload}
	kp.selfName, kp.selfFrom = f.selfName()
	if err := kp.reload(); err != nil {
		return nil, err
	}
	return kp, nil
}

// readBundle reads a PEM CA bundle.
func readBundle(label, path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("router: %s: read the CA bundle: %w", label, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("router: %s: %s holds no PEM certificate (want the CA's certificate, BEGIN CERTIFICATE)", label, path)
	}
	return pool, nil
}

// verifyPair checks that pair chains to roots for both uses: a node's one
// certificate is its server certificate and its client certificate.
func verifyPair(pair *tls.Certificate, roots *x509.CertPool) error {
	for _, use := range []struct {
		name string
		eku  x509.ExtKeyUsage
	}{{"server", x509.ExtKeyUsageServerAuth}, {"client", x509.ExtKeyUsageClientAuth}} {
		if _, err := pair.Leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: intermediates(pair),
			KeyUsages: []x509.ExtKeyUsage{use.eku}}); err != nil {
			var invalid x509.CertificateInvalidError
			if errors.As(err, &invalid) && invalid.Reason == x509.IncompatibleUsage {
				return fmt.Errorf("not valid as a %s certificate under the CA bundle (it is both, so its extended key usages must allow both or be absent): %w", use.name, err)
			}
			return fmt.Errorf("not valid under the CA bundle: %w", err)
		}
	}
	return nil
}

func intermediates(c *tls.Certificate) *x509.CertPool {
	pool := x509.NewCertPool()
	for _, der := range c.Certificate[1:] {
		if ic, err := x509.ParseCertificate(der); err == nil {
			pool.AddCert(ic)
		}
	}
	return pool
}

// keyPair is a certificate and key, and for mutual TLS the CA bundle they
// chain to, read again as one set when any of the files changes.
type keyPair struct {
	label         string // what the pair is for, in errors: "RPC TLS"
	cert, key, ca string // ca: "" when the pair chains to no bundle of ours (HTTPS)
	// selfName is the name the certificate must carry, and selfFrom why
	// (TLSFiles.selfName); "" checks none.
	selfName, selfFrom string
	onReload           func(error)
	mu                 sync.Mutex // protects current, roots and stamp
	current            *tls.Certificate
	// roots is the CA bundle read with current (nil without ca): the pair
	// chains to it for both uses, and peers are checked against it.
	roots *x509.CertPool
	stamp [3]fileStamp // of cert, key and ca when last read
}

type fileStamp struct {
	size int64
	mod  time.Time
}

func stampOf(path string) (fileStamp, error) {
	if path == "" {
		return fileStamp{}, nil
	}
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	return fileStamp{fi.Size(), fi.ModTime()}, nil
}

// get returns the pair and its CA bundle, read again first if a file
// changed. A set that no longer loads or verifies keeps the previous one:
// a rotation written half-way must not break the handshakes in between.
func (k *keyPair) get() (*tls.Certificate, *x509.CertPool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	var now [3]fileStamp
	for i, path := range []string{k.cert, k.key, k.ca} {
		var err error
		if now[i], err = stampOf(path); err != nil {
			// A file gone for a moment (a rename in progress): keep the
			// set, and look again at the next handshake.
			return k.current, k.roots
		}
	}
	if now != k.stamp {
		err := k.reloadLocked()
		if err != nil {
			// Tried once per change, not at every handshake.
			k.stamp = now
		}
		if k.onReload != nil {
			k.onReload(err)
		}
	}
	return k.current, k.roots
}

func (k *keyPair) reload() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.reloadLocked()
}

func (k *keyPair) reloadLocked() error {
	var stamp [3]fileStamp
	var err error
	if stamp[2], err = stampOf(k.ca); err != nil {
		return fmt.Errorf("router: %s: read the CA bundle: %w", k.label, err)
	}
	c, errC := stampOf(k.cert)
	s, errK := stampOf(k.key)
	switch {
	case errC != nil && errK != nil:
		return fmt.Errorf("router: %s: the certificate: %w; the key: %w", k.label, errC, errK)
	case errC != nil:
		return fmt.Errorf("router: %s: the certificate: %w", k.label, errC)
	case errK != nil:
		return fmt.Errorf("router: %s: the key: %w", k.label, errK)
	}
	stamp[0], stamp[1] = c, s
	var roots *x509.CertPool
	if k.ca != "" {
		if roots, err = readBundle(k.label, k.ca); err != nil {
			return err
		}
	}
	certPEM, err := os.ReadFile(k.cert)
	if err != nil {
		return fmt.Errorf("router: %s: %w", k.label, err)
	}
	keyPEM, err := os.ReadFile(k.key)
	if err != nil {
		return fmt.Errorf("router: %s: %w", k.label, err)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		if bytes.Contains(certPEM, []byte("PRIVATE KEY")) || !bytes.Contains(keyPEM, []byte("PRIVATE KEY")) {
			err = fmt.Errorf("%w (are the certificate and key files swapped?)", err)
		}
		return fmt.Errorf("router: %s: load %s and %s: %w", k.label, k.cert, k.key, err)
	}
	if roots != nil {
		if err := verifyPair(&pair, roots); err != nil {
			return fmt.Errorf("router: %s: %s: %w (CA bundle %s)", k.label, k.cert, err, k.ca)
		}
		if k.selfName != "" {
			if err := pair.Leaf.VerifyHostname(k.selfName); err != nil {
				return fmt.Errorf("router: %s: %s does not carry the name %s (%s): every other node would refuse its calls to this one: "+
					"issue the certificate with %s as a subject alternative name, or give every node --rpc-tls-server-name, a DNS name all their certificates carry (%v)",
					k.label, k.cert, k.selfName, k.selfFrom, k.selfName, err)
			}
		}
	} else if now := time.Now(); now.After(pair.Leaf.NotAfter) || now.Before(pair.Leaf.NotBefore) {
		return fmt.Errorf("router: %s: %s is valid from %s to %s, not now: every client would refuse it; renew it",
			k.label, k.cert, pair.Leaf.NotBefore.UTC().Format(time.RFC3339), pair.Leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	k.current, k.roots, k.stamp = &pair, roots, stamp
	return nil
}

// CertNotAfter is when the certificate that cfg, a server config of
// TLSFiles or CertFiles, presents stops being valid (its files are read
// again first if they changed, as at a handshake); false for a config of
// neither, or nil.
func CertNotAfter(cfg *tls.Config) (time.Time, bool) {
	var pair *tls.Certificate
	switch {
	case cfg == nil:
		return time.Time{}, false
	case cfg.GetCertificate != nil:
		pair, _ = cfg.GetCertificate(&tls.ClientHelloInfo{})
	case cfg.GetConfigForClient != nil:
		if c, err := cfg.GetConfigForClient(&tls.ClientHelloInfo{}); err == nil && c != nil && len(c.Certificates) > 0 {
			pair = &c.Certificates[0]
		}
	}
	if pair == nil || pair.Leaf == nil {
		return time.Time{}, false
	}
	return pair.Leaf.NotAfter, true
}

// CertFiles names the PEM certificate chain and key a node serves HTTPS
// with on its public or its admin port (quotad serve --http-tls-* and
// --admin-tls-*). Clients are not asked for certificates there: the API
// keys and the admin token say who they are; TLS keeps those secrets, and
// the answers, from the network. Like TLSFiles, the pair is read again when
// either file changes (a renewal needs no restart) and a pair that does not
// load keeps the previous one.
type CertFiles struct {
	// Cert is the certificate chain, leaf first, as a CA issued it
	// (clients verify it against their own roots); Key its private key.
	Cert, Key string
	// OnReload, when set, hears of every reading after the first: nil when
	// the new pair is in use, else why the previous one stays.
	OnReload func(error)
}

// Enabled reports whether either file is named.
func (f CertFiles) Enabled() bool { return f.Cert != "" || f.Key != "" }

// ServerConfig loads the pair and returns the TLS config of an HTTPS port
// (TLS 1.2 or later, the pair read again when a file changes). what names
// the port's flags in errors, such as "--http-tls".
func (f CertFiles) ServerConfig(what string) (*tls.Config, error) {
	switch {
	case f.Cert == "" && f.Key == "":
		return nil, fmt.Errorf("router: %s: no certificate and key given", what)
	case f.Cert == "":
		return nil, fmt.Errorf("router: %s: a key without its certificate; give %s-cert too", what, what)
	case f.Key == "":
		return nil, fmt.Errorf("router: %s: a certificate without its key; give %s-key too", what, what)
	}
	kp := &keyPair{label: what, cert: f.Cert, key: f.Key, onReload: f.OnReload}
	if err := kp.reload(); err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion:     tls.VersionTLS12,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { pair, _ := kp.get(); return pair, nil },
	}, nil
}
