package wal

import (
	"bytes"
	"testing"
)

func TestFrameRoundTrip(t *testing.T) {
	for _, p := range [][]byte{nil, {}, []byte("x"), bytes.Repeat([]byte{0xff}, 1000)} {
		got, err := decodeFrame(encodeFrame(p))
		if err != nil || !bytes.Equal(got, p) {
			t.Fatalf("decode(encode(%q)) = %q, %v", p, got, err)
		}
	}
}

func TestDecodeFrameRejects(t *testing.T) {
	good := encodeFrame([]byte("payload"))
	flip := func(i int) []byte {
		b := bytes.Clone(good)
		b[i] ^= 1
		return b
	}
	for name, frame := range map[string][]byte{
		"empty":          {},
		"short header":   good[:4],
		"version 0":      append([]byte{0}, good[1:]...),
		"version 2":      append([]byte{2}, good[1:]...),
		"crc bit":        flip(1),
		"payload bit":    flip(len(good) - 1),
		"truncated body": good[:len(good)-1],
	} {
		if _, err := decodeFrame(frame); err == nil {
			t.Errorf("%s: decodeFrame(%x) accepted a bad frame", name, frame)
		}
	}
}

func TestRecordKeys(t *testing.T) {
	for _, seq := range []uint64{0, 1, 255, 256, 1 << 40, ^uint64(0)} {
		k := recordKey(seq)
		got, err := parseRecordKey(k)
		if err != nil || got != seq {
			t.Fatalf("parseRecordKey(recordKey(%d)) = %d, %v", seq, got, err)
		}
		after := recordKeyAfter(seq)
		if bytes.Compare(after, k) <= 0 {
			t.Fatalf("recordKeyAfter(%d) = %x is not after %x", seq, after, k)
		}
		if seq < ^uint64(0) && bytes.Compare(after, recordKey(seq+1)) >= 0 {
			t.Fatalf("recordKeyAfter(%d) = %x is not before the key of %d", seq, after, seq+1)
		}
	}
	if bytes.Compare(recordKey(255), recordKey(256)) >= 0 {
		t.Fatal("record keys do not sort by sequence")
	}
	if _, err := parseRecordKey([]byte("r123")); err == nil {
		t.Fatal("parseRecordKey accepted a short key")
	}
}

// FuzzDecodeFrame checks that decodeFrame never panics, and that whatever it
// accepts is exactly the frame encodeFrame writes for that payload.
func FuzzDecodeFrame(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{frameVersion})
	f.Add(encodeFrame(nil))
	f.Add(encodeFrame([]byte("charge acct-1 5 units")))
	f.Add(append([]byte{2}, encodeFrame([]byte("v2"))[1:]...))
	f.Add([]byte{frameVersion, 0, 0, 0, 0, 'x'})
	f.Fuzz(func(t *testing.T, frame []byte) {
		payload, err := decodeFrame(frame)
		if err != nil {
			return
		}
		if again := encodeFrame(payload); !bytes.Equal(again, frame) {
			t.Fatalf("decodeFrame accepted %x, but its payload encodes as %x", frame, again)
		}
	})
}
