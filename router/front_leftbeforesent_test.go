package router

import (
	"bufio"
	"context"
	"io"
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

// A kept-alive upstream connection that the upstream closed as the next
// request arrived (an idle timeout crossing it): the transport sends that
// GET again on a fresh connection. A client that leaves while the retry
// dials was never served, since the first try went nowhere: refunded. Before,
// the first try's written head marked it as having reached the upstream, and
// the charge stood.
func TestClientLeftDuringTransportRetryIsRefunded(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	served := make(chan struct{}, 1)
	go func() { // the upstream: one connection, one answer, then closed under the second request
		conn, err := lis.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		br := bufio.NewReader(conn)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		served <- struct{}{}
		http.ReadRequest(br) // the second request arrives; the upstream closes instead of answering
	}()
	retrying := make(chan struct{}, 1)
	dials := 0
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials++ // NB: one request at a time
		if dials == 1 {
			var d net.Dialer
			return d.DialContext(ctx, network, lis.Addr().String())
		}
		retrying <- struct{}{}
		<-ctx.Done() // the retry's connection is slow to come
		return nil, ctx.Err()
	}}
	u, _ := url.Parse("http://upstream.invalid:80")
	ch := &fakeCharger{decision: okDecision()}
	done := make(chan int, 2)
	proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t), Transport: tr,
		OnRequest: func(code int, _ time.Duration) { done <- code }})
	if err != nil {
		t.Fatal(err)
	}
	front := httptest.NewServer(proxy)
	defer front.Close()
	get := func(ctx context.Context) (*http.Response, error) {
		req, _ := http.NewRequestWithContext(ctx, "GET", front.URL+"/v1/tasks", nil)
		req.Header.Set("X-Api-Key", "secret")
		return http.DefaultClient.Do(req)
	}
	res, err := get(context.Background())
	if err != nil || res.StatusCode != 200 {
		t.Fatalf("first request: %v, %v", res, err)
	}
	res.Body.Close()
	<-served
	if code := <-done; code != 200 {
		t.Fatalf("first request finished %d", code)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		res, err := get(ctx)
		if err == nil {
			res.Body.Close()
		}
		errc <- err
	}()
	select {
	case <-retrying:
	case <-time.After(10 * time.Second):
		t.Fatal("the transport never tried the second request again")
	}
	cancel()
	<-errc
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the front never finished the second request")
	}
	if c, r := ch.counts(); c != 2 || r != 1 {
		t.Fatalf("%d charges, %d refunds; want 2 charges, the second refunded (the upstream never read it)", c, r)
	}
}
