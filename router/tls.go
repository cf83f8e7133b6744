package router

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
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
// The files are PEM, as cert-manager and `openssl` write them. The
// certificate and key are read again when either file changes (checked at
// each handshake; connections live long, so that is rare), so a renewed
// certificate is used without a restart; a pair that does not load (a
// rotation caught half-written) keeps the previous one. The CA bundle is
// read at start: rotate a CA by putting the old and the new in one bundle,
// a rolling restart, then the new alone.

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
	// OnReload, when set, hears of every reading of Cert and Key after the
	// first (a file changed): nil when the new pair is in use, else why the
	// previous one stays.
	OnReload func(error)
}

// Enabled reports whether any file is named.
func (f TLSFiles) Enabled() bool { return f.Cert != "" || f.Key != "" || f.CA != "" }

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
// files (so a renewed certificate is read, and OnReload told, once).
func (f TLSFiles) Configs() (server, client *tls.Config, err error) {
	kp, pool, err := f.load()
	if err != nil {
		return nil, nil, err
	}
	server = &tls.Config{
		MinVersion:     tls.VersionTLS13,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return kp.get() },
		ClientAuth:     tls.RequireAndVerifyClientCert,
		ClientCAs:      pool,
	}
	client = &tls.Config{
		MinVersion:           tls.VersionTLS13,
		RootCAs:              pool,
		ServerName:           f.ServerName,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return kp.get() },
	}
	return server, client, nil
}

func (f TLSFiles) load() (*keyPair, *x509.CertPool, error) {
	var missing []string
	for _, x := range []struct{ name, path string }{{"certificate (--rpc-tls-cert)", f.Cert}, {"key (--rpc-tls-key)", f.Key}, {"CA bundle (--rpc-tls-ca)", f.CA}} {
		if x.path == "" {
			missing = append(missing, x.name)
		}
	}
	if len(missing) > 0 {
		return nil, nil, fmt.Errorf("router: RPC TLS needs a certificate, its key and the CA bundle; missing: %v", missing)
	}
	pem, err := os.ReadFile(f.CA)
	if err != nil {
		return nil, nil, fmt.Errorf("router: RPC TLS: read the CA bundle: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, nil, fmt.Errorf("router: RPC TLS: %s holds no PEM certificate (want the CA's certificate, BEGIN CERTIFICATE)", f.CA)
	}
	kp := &keyPair{label: "RPC TLS", cert: f.Cert, key: f.Key, ca: f.CA, roots: pool, onReload: f.OnReload}
	if err := kp.reload(); err != nil {
		return nil, nil, err
	}
	return kp, pool, nil
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
			return fmt.Errorf("not valid as a %s certificate under the CA bundle (it is both, so its extended key usages must allow both or be absent): %w", use.name, err)
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

// keyPair is a certificate and key read again when either file changes.
type keyPair struct {
	label         string // what the pair is for, in errors: "RPC TLS"
	cert, key, ca string
	// roots, when set, is the CA bundle the pair must chain to for both
	// uses (mutual TLS); nil: the pair must only load and be in date.
	roots    *x509.CertPool
	onReload func(error)
	mu       sync.Mutex // protects current and stamp
	current  *tls.Certificate
	stamp    [2]fileStamp // of cert and key when current was read
}

type fileStamp struct {
	size int64
	mod  time.Time
}

func stampOf(path string) (fileStamp, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	return fileStamp{fi.Size(), fi.ModTime()}, nil
}

// get returns the pair, read again first if a file changed. A pair that no
// longer loads or verifies keeps the previous one: a rotation written
// half-way must not break the handshakes in between.
func (k *keyPair) get() (*tls.Certificate, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	c, errC := stampOf(k.cert)
	s, errK := stampOf(k.key)
	if errC == nil && errK == nil && (c != k.stamp[0] || s != k.stamp[1]) {
		err := k.reloadLocked()
		if err != nil {
			// Tried once per change, not at every handshake.
			k.stamp = [2]fileStamp{c, s}
		}
		if k.onReload != nil {
			k.onReload(err)
		}
	}
	return k.current, nil
}

func (k *keyPair) reload() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.reloadLocked()
}

func (k *keyPair) reloadLocked() error {
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
	if k.roots != nil {
		if err := verifyPair(&pair, k.roots); err != nil {
			return fmt.Errorf("router: %s: %s: %w (CA bundle %s)", k.label, k.cert, err, k.ca)
		}
	} else if now := time.Now(); now.After(pair.Leaf.NotAfter) || now.Before(pair.Leaf.NotBefore) {
		return fmt.Errorf("router: %s: %s is valid from %s to %s, not now: every client would refuse it; renew it",
			k.label, k.cert, pair.Leaf.NotBefore.UTC().Format(time.RFC3339), pair.Leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	k.current, k.stamp = &pair, [2]fileStamp{c, s}
	return nil
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
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return kp.get() },
	}, nil
}
