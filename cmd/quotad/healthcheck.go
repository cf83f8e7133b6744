package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// newHealthcheckCmd is quotad healthcheck: a probe of a node's admin port
// for images without a shell or an HTTP client (the distroless image's
// Docker HEALTHCHECK, Compose's depends_on: service_healthy).
func newHealthcheckCmd() *cobra.Command {
	var target, caCert string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "healthcheck",
		Short: "Probe a node's /readyz or /healthz and exit 0 when it answers 2xx",
		Long: `Ask a node's admin port whether it is ready (/readyz, the default) or alive
(/healthz), and exit 0 when it answers 2xx, 1 otherwise, saying what it got. It
is the probe for images without a shell or an HTTP client, such as quotad's
own (distroless): Docker's HEALTHCHECK and Compose's depends_on with
condition: service_healthy. Kubernetes probes the same endpoints itself.

/readyz answers 503 while the node starts, drains or cannot serve (its body
says why); /healthz only says the process answers, ledger or not.`,
		Example: `  quotad healthcheck                                   # http://127.0.0.1:9090/readyz
  quotad healthcheck --url http://127.0.0.1:9090/healthz
  quotad healthcheck --url https://127.0.0.1:9090/readyz --ca-cert /etc/quotad/ca.pem
  # Dockerfile or Compose:
  HEALTHCHECK --interval=10s --timeout=5s CMD ["/usr/local/bin/quotad", "healthcheck"]`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runHealthcheck(cmd.Context(), cmd.OutOrStdout(), target, caCert, timeout)
		},
	}
	cmd.Flags().StringVar(&target, "url", defaultHealthURL(os.Getenv("QUOTAD_ADMIN_ADDR"), os.Getenv("QUOTAD_ADMIN_TLS_CERT") != ""),
		"what to probe: the node's admin address and /readyz or /healthz (the default follows QUOTAD_ADMIN_ADDR and QUOTAD_ADMIN_TLS_CERT when set, as in the container the node runs in)")
	cmd.Flags().StringVar(&caCert, "ca-cert", "", "PEM file of the CA that signed the admin port's certificate (--admin-tls-cert), for an https:// --url")
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Second, "how long to wait for the answer")
	return cmd
}

// defaultHealthURL is /readyz on this machine at the port of adminAddr
// (QUOTAD_ADMIN_ADDR, the node's --admin-addr from the environment; :9090
// when empty), over https when the node serves the port with TLS.
func defaultHealthURL(adminAddr string, tlsOn bool) string {
	host, port := "127.0.0.1", "9090"
	if h, p, err := net.SplitHostPort(adminAddr); err == nil && p != "" && p != "0" {
		port = p
		if h != "" && h != "0.0.0.0" && h != "::" {
			host = h // a node bound to one address answers only there
		}
	}
	scheme := "http"
	if tlsOn {
		scheme = "https"
	}
	return scheme + "://" + net.JoinHostPort(host, port) + "/readyz"
}

// runHealthcheck probes target once.
func runHealthcheck(ctx context.Context, out io.Writer, target, caCert string, timeout time.Duration) error {
	u, err := url.Parse(target)
	switch {
	case err != nil:
		return fmt.Errorf("--url %q: %v", target, err)
	case u.Scheme != "http" && u.Scheme != "https", u.Host == "":
		return fmt.Errorf("--url %q: want http://HOST:PORT/readyz (or https://, or /healthz): the node's --admin-addr", target)
	case timeout <= 0:
		return fmt.Errorf("--timeout %s: want a positive duration such as 5s", timeout)
	case caCert != "" && u.Scheme != "https":
		return fmt.Errorf("--ca-cert is for an https:// --url; %q is %s", target, u.Scheme)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.Proxy = nil // a probe of this machine's own port: never through HTTP_PROXY
	if caCert != "" {
		pem, err := os.ReadFile(caCert)
		if err != nil {
			return fmt.Errorf("--ca-cert: %v", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("--ca-cert %s: no PEM certificate in it", caCert)
		}
		tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return fmt.Errorf("--url %q: %v", target, err)
	}
	res, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return fmt.Errorf("%s did not answer: %v (is the node running, and --url its --admin-addr?)", u.Redacted(), err)
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(res.Body, 4<<10))
	why := strings.TrimSpace(string(body))
	if res.StatusCode/100 != 2 {
		return fmt.Errorf("%s answered %s: %s", u.Redacted(), res.Status, why)
	}
	fmt.Fprintf(out, "%s: %s %s\n", u.Redacted(), res.Status, why)
	return nil
}
