package faultproxy

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// msg builds a typed protocol message.
func msg(typ byte, body string) []byte {
	b := []byte{typ, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(b[1:], uint32(4+len(body)))
	return append(b, body...)
}

// startupPacket builds an untyped startup-phase packet.
func startupPacket(code uint32, body string) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint32(b[0:], uint32(8+len(body)))
	binary.BigEndian.PutUint32(b[4:], code)
	return append(b, body...)
}

// stream concatenates parts and returns where each part ends.
func stream(parts ...[]byte) (all []byte, ends []int) {
	for _, p := range parts {
		all = append(all, p...)
		ends = append(ends, len(all))
	}
	return all, ends
}

// chunkings splits b in several ways: whole, byte by byte, and at random
// (seeded, so a failure reproduces).
func chunkings(b []byte) map[string][][]byte {
	out := map[string][][]byte{"whole": {b}}
	var ones [][]byte
	for i := range b {
		ones = append(ones, b[i:i+1])
	}
	out["bytes"] = ones
	for seed := uint64(1); seed <= 20; seed++ {
		r := rand.New(rand.NewPCG(seed, 0))
		var cs [][]byte
		for rest := b; len(rest) > 0; {
			n := min(1+r.IntN(12), len(rest))
			cs = append(cs, rest[:n])
			rest = rest[n:]
		}
		out[fmt.Sprintf("seed=%d", seed)] = cs
	}
	return out
}

// commitEnds feeds chunks to a frontend parser the way the proxy does and
// returns the stream offsets at which it reported a COMMIT.
func commitEnds(ws *wireState, chunks [][]byte) []int {
	fe := newFrontendParser(ws)
	var ends []int
	pos := 0
	for _, c := range chunks {
		for off := 0; off < len(c); {
			k, commit := fe.advance(c[off:])
			off += k
			if commit {
				ends = append(ends, pos+off)
			}
		}
		pos += len(c)
	}
	return ends
}

func TestFrontendFindsCommits(t *testing.T) {
	all, ends := stream(
		startupPacket(codeGSSENCRequest, ""),
		startupPacket(codeSSLRequest, ""),
		startupPacket(196608, "user\x00postgres\x00database\x00x\x00\x00"),
		msg('Q', "select 1;\x00"),
		msg('P', "\x00commit\x00\x00\x00"),   // extended protocol: not recognized
		msg('Q', "COMMIT;\x00"),              // 5
		msg('Q', "  end transaction ; \x00"), // 6
		msg('Q', "commit prepared 'x'\x00"),
		msg('Q', "rollback\x00"),
		msg('Q', "commit"+strings.Repeat(" ", 100)+"\x00"), // too long to buffer
		msg('Q', "insert into commit values (1)\x00"),
		msg('Q', "commit\x00"), // 11
		msg('X', ""),
	)
	want := []int{ends[5], ends[6], ends[11]}
	for name, chunks := range chunkings(all) {
		var ws wireState
		if got := commitEnds(&ws, chunks); !slices.Equal(got, want) {
			t.Errorf("%s: commits end at %v, want %v", name, got, want)
		}
		if n := ws.pendingAnswers.Load(); n != 2 {
			t.Errorf("%s: pendingAnswers = %d, want 2 (GSSENC and SSL requests)", name, n)
		}
		if ws.opaque.Load() {
			t.Errorf("%s: parser gave up on a valid stream", name)
		}
	}
}

func TestFrontendStopsWhenEncrypted(t *testing.T) {
	var ws wireState
	fe := newFrontendParser(&ws)
	if _, commit := fe.advance(startupPacket(codeSSLRequest, "")); commit {
		t.Fatal("SSLRequest taken for a commit")
	}
	be := backendParser{ws: &ws}
	be.advance([]byte{'S'}) // the server agrees to TLS
	if !ws.opaque.Load() {
		t.Fatal("'S' answer did not make the stream opaque")
	}
	// Whatever follows is TLS; even bytes that look like a COMMIT are not one.
	bogus := append(startupPacket(196608, "user\x00u\x00\x00"), msg('Q', "commit\x00")...)
	if _, commit := fe.advance(bogus); commit {
		t.Error("found a commit in an encrypted stream")
	}
}

func TestFrontendGivesUpOnGarbage(t *testing.T) {
	var ws wireState
	fe := newFrontendParser(&ws)
	if n, commit := fe.advance([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n")); commit || n == 0 {
		t.Fatalf("advance = %d, %v", n, commit)
	}
	if !ws.opaque.Load() {
		t.Error("HTTP bytes did not make the parser give up")
	}
}

func TestBackendFindsReadyForQuery(t *testing.T) {
	all, ends := stream(
		[]byte{'N'}, // answer to SSLRequest: plain text
		msg('R', "\x00\x00\x00\x00"),
		msg('S', "TimeZone\x00UTC\x00"),
		msg('K', "12345678"),
		msg('Z', "I"),                // 4
		msg('N', "SWARNING\x00\x00"), // NoticeResponse: also 'N', but framed
		msg('C', "COMMIT\x00"),
		msg('Z', "I"), // 7
	)
	// The parser reports a 'Z' in the read that completes its 5-byte header.
	want := []int{ends[3] + 5, ends[6] + 5}
	for name, chunks := range chunkings(all) {
		var ws wireState
		ws.pendingAnswers.Store(1)
		be := backendParser{ws: &ws}
		var got []int
		pos := 0
		for _, c := range chunks {
			pos += len(c)
			if be.advance(c) {
				got = append(got, pos)
			}
		}
		// A chunk may hold both; then it is reported once.
		var wantHere []int
		for _, w := range want {
			i := slices.IndexFunc(chunkEnds(chunks), func(e int) bool { return e >= w })
			e := chunkEnds(chunks)[i]
			if !slices.Contains(wantHere, e) {
				wantHere = append(wantHere, e)
			}
		}
		if !slices.Equal(got, wantHere) {
			t.Errorf("%s: ReadyForQuery reported at %v, want %v", name, got, wantHere)
		}
		if ws.opaque.Load() || ws.pendingAnswers.Load() != 0 {
			t.Errorf("%s: opaque=%v pending=%d", name, ws.opaque.Load(), ws.pendingAnswers.Load())
		}
	}
}

func chunkEnds(chunks [][]byte) []int {
	var ends []int
	pos := 0
	for _, c := range chunks {
		pos += len(c)
		ends = append(ends, pos)
	}
	return ends
}

func TestIsCommit(t *testing.T) {
	for q, want := range map[string]bool{
		"commit\x00":              true,
		"COMMIT":                  true,
		"Commit;\x00":             true,
		" commit work ;;\x00":     true,
		"COMMIT TRANSACTION":      true,
		"end":                     true,
		"END WORK;":               true,
		"\tend\ttransaction\n":    true,
		"":                        false,
		"\x00":                    false,
		"commit prepared 'x'":     false,
		"commit and chain":        false,
		"rollback":                false,
		"begin":                   false,
		"select 'commit'":         false,
		"commit; select 1":        false,
		"/* c */ commit":          false,
		"endtransaction":          false,
		"commit work transaction": false,
	} {
		if got := isCommit([]byte(q)); got != want {
			t.Errorf("isCommit(%q) = %v, want %v", q, got, want)
		}
	}
}
