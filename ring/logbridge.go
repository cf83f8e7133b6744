package ring

import (
	"bytes"
	"context"
	"log"
	"log/slog"
	"sync"
	"time"

	"github.com/quotaring/quotaring/internal/logsample"
)

// slogWriter turns memberlist's "[LEVEL] memberlist: message" lines into
// slog records at the matching level, so memberlist logs where the ring logs
// and its DEBUG chatter is filtered like everything else.
//
// Its warnings and errors come once per probe or packet while their cause
// lasts (a peer with another gossip key: "Decrypt packet failed" several
// times a second from every such peer; two nodes with one id: "Conflicting
// address"), so each kind of line (its text up to the first colon) goes out
// once per memberlistLogEvery, with the count of those held back.
type slogWriter struct {
	log *slog.Logger
	now func() time.Time

	mu       sync.Mutex // protects samplers
	samplers map[string]*logsample.Sampler
}

// memberlistLogEvery is how often one kind of memberlist warning or error
// is logged while it repeats.
const memberlistLogEvery = 10 * time.Second

// maxSampledKinds bounds the kinds of line sampled apart; the rest share one
// sampler.
const maxSampledKinds = 64

// newStdLogger returns a *log.Logger (the type memberlist takes) that writes
// to l.
func newStdLogger(l *slog.Logger) *log.Logger {
	return log.New(newSlogWriter(l, time.Now), "", 0)
}

func newSlogWriter(l *slog.Logger, now func() time.Time) *slogWriter {
	return &slogWriter{log: l, now: now, samplers: map[string]*logsample.Sampler{}}
}

func (w *slogWriter) Write(p []byte) (int, error) {
	level, msg := splitLevel(bytes.TrimSpace(p))
	msg = bytes.TrimPrefix(msg, []byte("memberlist: "))
	ctx := context.Background()
	if !w.log.Enabled(ctx, level) {
		return len(p), nil
	}
	if level < slog.LevelWarn {
		w.log.Log(ctx, level, string(msg))
		return len(p), nil
	}
	ok, held := w.sampler(msg).Allow(w.now(), memberlistLogEvery)
	switch {
	case !ok:
	case held > 0:
		w.log.Log(ctx, level, string(msg), "similar_lines_held_back", held)
	default:
		w.log.Log(ctx, level, string(msg))
	}
	return len(p), nil
}

// sampler is the sampler of msg's kind: its text up to the first colon.
func (w *slogWriter) sampler(msg []byte) *logsample.Sampler {
	kind, _, _ := bytes.Cut(msg, []byte(":"))
	w.mu.Lock()
	defer w.mu.Unlock()
	s, ok := w.samplers[string(kind)]
	if !ok {
		if len(w.samplers) >= maxSampledKinds {
			kind = nil
			if s, ok = w.samplers[""]; ok {
				return s
			}
		}
		s = &logsample.Sampler{}
		w.samplers[string(kind)] = s
	}
	return s
}

// splitLevel cuts memberlist's level prefix off a line.
func splitLevel(line []byte) (slog.Level, []byte) {
	if len(line) == 0 || line[0] != '[' {
		return slog.LevelInfo, line
	}
	tag, rest, ok := bytes.Cut(line, []byte("] "))
	if !ok {
		return slog.LevelInfo, line
	}
	switch string(tag[1:]) {
	case "DEBUG":
		return slog.LevelDebug, rest
	case "INFO":
		return slog.LevelInfo, rest
	case "WARN":
		return slog.LevelWarn, rest
	case "ERR", "ERROR":
		return slog.LevelError, rest
	}
	return slog.LevelInfo, line
}
