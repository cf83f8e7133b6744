// Package pki makes a throwaway certificate authority and the certificates
// it signs, for clusters on one machine: `quotad demo`, the chaos harness
// and the tests run their nodes' internal RPC over mutual TLS with it
// (quotad serve --rpc-tls-*), as a production cluster would with its own
// CA (cert-manager, Vault, or openssl by hand; deploy/README.md).
//
// It is not a CA for production: keys are ECDSA P-256 written unencrypted
// next to the certificates, nothing is revoked, and certificates live a
// day unless asked otherwise.
//
//	ca, _ := pki.NewCA("demo CA")
//	files, _ := ca.WriteFiles(dir, "node", pki.Names{DNS: []string{"quotad.internal"}})
//	files.ServerName = "quotad.internal" // a router.TLSFiles, for every node and client
package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/quotaring/quotaring/router"
)

// CA is a self-signed certificate authority held in memory.
type CA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	// PEM is the CA's certificate, for --rpc-tls-ca.
	PEM []byte
}

// NewCA makes a CA named name, valid from an hour ago for a year.
func NewCA(name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(365 * 24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("pki: self-sign %s: %w", name, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{cert: cert, key: key, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

// Names are what a certificate is valid for, and how.
type Names struct {
	DNS []string
	IPs []net.IP
	// Usages are its extended key usages; nil is server and client auth,
	// which a node's certificate needs (it is both).
	Usages []x509.ExtKeyUsage
	// NotBefore and NotAfter default to an hour ago and a day from now.
	NotBefore, NotAfter time.Time
}

// Issue signs a new key's certificate for names and returns both as PEM.
func (ca *CA) Issue(commonName string, names Names) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	if names.NotBefore.IsZero() {
		names.NotBefore = now.Add(-time.Hour)
	}
	if names.NotAfter.IsZero() {
		names.NotAfter = now.Add(24 * time.Hour)
	}
	if names.Usages == nil {
		names.Usages = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: commonName},
		DNSNames:     names.DNS,
		IPAddresses:  names.IPs,
		NotBefore:    names.NotBefore,
		NotAfter:     names.NotAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  names.Usages,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return nil, nil, fmt.Errorf("pki: sign %s: %w", commonName, err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), nil
}

// WriteFiles issues a certificate for names and writes dir/ca.pem,
// dir/NAME.pem and dir/NAME-key.pem (the key readable by its owner only).
func (ca *CA) WriteFiles(dir, name string, names Names) (router.TLSFiles, error) {
	certPEM, keyPEM, err := ca.Issue(name, names)
	if err != nil {
		return router.TLSFiles{}, err
	}
	f := router.TLSFiles{CA: filepath.Join(dir, "ca.pem"), Cert: filepath.Join(dir, name+".pem"), Key: filepath.Join(dir, name+"-key.pem")}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return router.TLSFiles{}, err
	}
	for path, b := range map[string][]byte{f.CA: ca.PEM, f.Cert: certPEM} {
		if err := os.WriteFile(path, b, 0o644); err != nil {
			return router.TLSFiles{}, err
		}
	}
	if err := os.WriteFile(f.Key, keyPEM, 0o600); err != nil {
		return router.TLSFiles{}, err
	}
	return f, nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	return n
}
