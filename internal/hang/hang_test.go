package hang

import (
	"context"
	"errors"
	"testing"
)

func TestGate(t *testing.T) {
	g := New()
	if err := g.Wait(context.Background()); err != nil {
		t.Fatalf("a gate that is not hung held a call: %v", err)
	}
	g.Hung.Store(true)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Wait(ctx) }()
	<-g.Entered
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("a held call whose caller gave up: %v, want context.Canceled", err)
	}

	blind := New()
	blind.IgnoreCtx = true
	blind.Hung.Store(true)
	ctx, cancel = context.WithCancel(context.Background())
	cancel() // given up before the call: a blind gate holds it anyway
	go func() { done <- blind.Wait(ctx) }()
	<-blind.Entered
	select {
	case err := <-done:
		t.Fatalf("a blind gate let a cancelled call go before its release: %v", err)
	default:
	}
	blind.Release()
	blind.Release() // a second release does nothing
	if err := <-done; err != nil {
		t.Fatalf("a released call: %v, want nil", err)
	}
	if err := blind.Wait(ctx); err != nil {
		t.Fatalf("a call after the release: %v, want nil", err)
	}
}

func TestUntil(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := Until(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Until of a cancelled context: %v", err)
	}
}
