package router

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"
)

// A client that leaves after its charge but before the proxy sent its
// request on (the upstream is still being dialled) was not served: it is
// refunded under every bill-on policy, as a client that leaves while its
// charge is decided is. Under bill-on always the charge stood.
func TestClientLeftBeforeSentIsRefundedUnderAlways(t *testing.T) {
	for _, policy := range []string{BillOnSuccess, BillOn2xx, BillOnAlways} {
		t.Run(policy, func(t *testing.T) {
			dialing := make(chan struct{}, 1)
			tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				dialing <- struct{}{}
				<-ctx.Done() // an upstream that is slow to accept
				return nil, ctx.Err()
			}}
			u, _ := url.Parse("http://upstream.invalid:80")
			ch := &fakeCharger{decision: okDecision()}
			done := make(chan int, 1)
			proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t), BillOn: policy, Transport: tr,
				OnRequest: func(code int, _ time.Duration) { done <- code }})
			if err != nil {
				t.Fatal(err)
			}
			front := httptest.NewServer(proxy)
			defer front.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, "POST", front.URL+"/v1/tasks", nil)
			req.Header.Set("X-Api-Key", "secret")
			errc := make(chan error, 1)
			go func() {
				res, err := http.DefaultClient.Do(req)
				if err == nil {
					res.Body.Close()
				}
				errc <- err
			}()
			select {
			case <-dialing:
			case <-time.After(10 * time.Second):
				t.Fatal("the proxy never dialled the upstream")
			}
			cancel()
			<-errc
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("the front never finished the request")
			}
			if c, r := ch.counts(); c != 1 || r != 1 {
				t.Fatalf("bill-on %s: %d charges, %d refunds; want 1 charge refunded (the upstream never got the request)", policy, c, r)
			}
		})
	}
}
