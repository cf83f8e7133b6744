package ring

import (
	"bytes"
	"context"
	"log"
	"log/slog"
)

// slogWriter turns memberlist's "[LEVEL] memberlist: message" lines into
// slog records at the matching level, so memberlist logs where the ring logs
// and its DEBUG chatter is filtered like everything else.
type slogWriter struct {
	log *slog.Logger
}

// newStdLogger returns a *log.Logger (the type memberlist takes) that writes
// to l.
func newStdLogger(l *slog.Logger) *log.Logger {
	return log.New(slogWriter{log: l}, "", 0)
}

func (w slogWriter) Write(p []byte) (int, error) {
	level, msg := splitLevel(bytes.TrimSpace(p))
	msg = bytes.TrimPrefix(msg, []byte("memberlist: "))
	ctx := context.Background()
	if w.log.Enabled(ctx, level) {
		w.log.Log(ctx, level, string(msg))
	}
	return len(p), nil
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
