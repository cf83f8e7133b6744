package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestSecondInterruptEndsAtOnce runs notifyContext in a child process (this
// test binary again) that signals itself: the first SIGINT ends the
// context, a SIGTERM after it is ignored (a supervisor's repeat must not
// cut a drain short), and a second SIGINT kills the process at once.
// Before, every later signal was swallowed: a stop that hung could only be
// ended with kill -9 from another terminal.
func TestSecondInterruptEndsAtOnce(t *testing.T) {
	if os.Getenv("QUOTAD_TEST_SIGNAL_CHILD") == "1" {
		signalChild()
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestSecondInterruptEndsAtOnce$")
	cmd.Env = append(os.Environ(), "QUOTAD_TEST_SIGNAL_CHILD=1")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("child: %v, want it killed by SIGINT; output:\n%s", err, out)
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGINT {
		t.Fatalf("child ended with %v, want killed by SIGINT; output:\n%s", ee, out)
	}
	if !strings.Contains(string(out), "context ended") || !strings.Contains(string(out), "SIGTERM ignored") {
		t.Fatalf("child did not get through the first SIGINT and the SIGTERM; output:\n%s", out)
	}
}

func signalChild() {
	ctx, stop := notifyContext()
	defer stop()
	pid := os.Getpid()
	syscall.Kill(pid, syscall.SIGINT)
	select {
	case <-ctx.Done():
		fmt.Println("context ended by " + signalName(ctx))
	case <-time.After(10 * time.Second):
		fmt.Println("the first SIGINT did not end the context")
		os.Exit(2)
	}
	syscall.Kill(pid, syscall.SIGTERM)
	// Still alive: the SIGTERM was caught (a process killed by it never
	// prints this or sends the SIGINT below).
	fmt.Println("SIGTERM ignored")
	syscall.Kill(pid, syscall.SIGINT)
	<-time.After(10 * time.Second) // bounded: the SIGINT ends us long before
	fmt.Println("the second SIGINT did not end the process")
	os.Exit(2)
}

// TestHangupStopsInOrder: a closed terminal or a dropped SSH session
// (SIGHUP) ends the context as a Ctrl-C does; it killed the process at
// once (a node without its drain, the demo leaving 200 MB behind). Under
// nohup (SIGHUP ignored) it stays ignored.
func TestHangupStopsInOrder(t *testing.T) {
	switch os.Getenv("QUOTAD_TEST_HUP_CHILD") {
	case "caught":
		ctx, stop := notifyContext()
		defer stop()
		syscall.Kill(os.Getpid(), syscall.SIGHUP)
		select {
		case <-ctx.Done():
			fmt.Println("context ended by " + signalName(ctx))
		case <-time.After(10 * time.Second):
			fmt.Println("SIGHUP did not end the context")
		}
		return
	case "ignored":
		signal.Ignore(syscall.SIGHUP) // as nohup starts a process
		ctx, stop := notifyContext()
		defer stop()
		syscall.Kill(os.Getpid(), syscall.SIGHUP)
		select {
		case <-ctx.Done():
			fmt.Println("SIGHUP ended the context under nohup")
		case <-time.After(300 * time.Millisecond): // nothing to wait for: the signal was delivered, and ignored
			fmt.Println("still running")
		}
		return
	}
	// The signal is named (serve logs it): a SIGHUP from a supervisor's
	// reload or a logrotate script drained a node with only "signal
	// received" to show for it.
	for mode, want := range map[string]string{"caught": "context ended by SIGHUP", "ignored": "still running"} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHangupStopsInOrder$")
		cmd.Env = append(os.Environ(), "QUOTAD_TEST_HUP_CHILD="+mode)
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), want) {
			t.Errorf("%s: %v, output:\n%s\nwant %q", mode, err, out, want)
		}
	}
}

// JSON logs (the Kubernetes config's) give durations as text does: slog
// wrote "took":5000000, a number no reader could tell from a count.
func TestJSONLogsWriteDurationsWithTheirUnit(t *testing.T) {
	var out strings.Builder
	l, err := newLogger(&out, "info", "json")
	if err != nil {
		t.Fatal(err)
	}
	l.Info("settled", "took", 5*time.Millisecond, slog.Group("retry", "every", 10*time.Second), "records", 3)
	if s := out.String(); !strings.Contains(s, `"took":"5ms"`) || !strings.Contains(s, `"retry":{"every":"10s"}`) || !strings.Contains(s, `"records":3`) {
		t.Fatalf("JSON log line %s: want durations as 5ms and 10s, counts as numbers", s)
	}
}

// Settings that do nothing as they stand are named at start: a review set
// --bill-on without --upstream and --advertise-host beside addresses that
// all name their host, and the node took both without a word.
func TestServeWarnsOfSettingsWithoutEffect(t *testing.T) {
	warned := func(f serveFlags) string {
		var out strings.Builder
		f.warnIneffective(slog.New(slog.NewTextHandler(&out, nil)))
		return out.String()
	}
	base := serveFlags{rpcAddr: "127.0.0.1:7400", httpAddr: "127.0.0.1:8080", adminAddr: "127.0.0.1:9090", gossipAddr: "127.0.0.1:7946",
		drainTimeout: 10 * time.Second}
	base.front.upstreamTimeout = 30 * time.Second
	f := base
	f.changed = map[string]bool{"bill-on": true, "advertise-host": true}
	if out := warned(f); !strings.Contains(out, "ignored=--bill-on") || !strings.Contains(out, "--advertise-host has no effect") {
		t.Errorf("warnings:\n%s\nwant --bill-on without --upstream and --advertise-host named", out)
	}
	f = base
	f.upstream, f.changed = "http://127.0.0.1:8081", map[string]bool{"upstream-timeout": true}
	if out := warned(f); !strings.Contains(out, "longer than --drain-timeout") {
		t.Errorf("warnings:\n%s\nwant the upstream timeout over the drain named", out)
	}
	f = base
	f.rpcAddr, f.upstream, f.changed = ":7400", "http://127.0.0.1:8081", map[string]bool{"bill-on": true, "advertise-host": true}
	if out := warned(f); out != "" {
		t.Errorf("warnings for settings that take effect (defaults, an advertised listener on all addresses):\n%s", out)
	}
}
