package wal

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// frameVersion is the only frame layout this package writes and reads.
const frameVersion = 1

// frameHeaderLen is the version byte plus the crc32c.
const frameHeaderLen = 1 + 4

// castagnoli is the crc32c table (hardware accelerated on amd64 and arm64).
// It is immutable after init.
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

var (
	errShortFrame  = errors.New("frame shorter than its header")
	errBadChecksum = errors.New("checksum mismatch")
	errBadChunk    = errors.New("malformed chunk")
)

// checksum returns the crc32c of payload.
func checksum(payload []byte) uint32 {
	return crc32.Checksum(payload, castagnoli)
}

// encodeFrameInto writes the frame of payload, whose checksum is crc, into
// dst, which must be exactly frameHeaderLen+len(payload) bytes.
func encodeFrameInto(dst []byte, crc uint32, payload []byte) {
	dst[0] = frameVersion
	binary.LittleEndian.PutUint32(dst[1:frameHeaderLen], crc)
	copy(dst[frameHeaderLen:], payload)
}

// appendFrame appends the frame of payload, whose checksum is crc, to dst.
func appendFrame(dst []byte, crc uint32, payload []byte) []byte {
	dst = append(dst, frameVersion)
	dst = binary.LittleEndian.AppendUint32(dst, crc)
	return append(dst, payload...)
}

// encodeFrame returns a new frame holding payload.
func encodeFrame(payload []byte) []byte {
	dst := make([]byte, frameHeaderLen+len(payload))
	encodeFrameInto(dst, checksum(payload), payload)
	return dst
}

// frameVersionError is a frame of a version this build does not know: a
// higher one was written by a newer quotad.
type frameVersionError byte

func (v frameVersionError) Error() string { return fmt.Sprintf("unknown frame version %d", byte(v)) }

// decodeFrame checks frame and returns its payload, which aliases frame.
func decodeFrame(frame []byte) ([]byte, error) {
	if len(frame) < frameHeaderLen {
		return nil, fmt.Errorf("%w (%d bytes)", errShortFrame, len(frame))
	}
	if v := frame[0]; v != frameVersion {
		return nil, frameVersionError(v)
	}
	payload := frame[frameHeaderLen:]
	stored := binary.LittleEndian.Uint32(frame[1:frameHeaderLen])
	if got := checksum(payload); got != stored {
		return nil, fmt.Errorf("%w: stored %08x, computed %08x", errBadChecksum, stored, got)
	}
	return payload, nil
}

// chunk reads the records of one chunk value: uvarint count, then count
// times (uvarint frame length, frame). The record at index i has sequence
// first+i.
type chunk struct {
	rest  []byte
	count uint64
}

func openChunk(v []byte) (chunk, error) {
	n, k := binary.Uvarint(v)
	if k <= 0 || n == 0 {
		return chunk{}, fmt.Errorf("%w: no record count", errBadChunk)
	}
	return chunk{rest: v[k:], count: n}, nil
}

// next returns the next frame of the chunk.
func (c *chunk) next() ([]byte, error) {
	n, k := binary.Uvarint(c.rest)
	if k <= 0 || n > uint64(len(c.rest)-k) {
		return nil, fmt.Errorf("%w: truncated entry", errBadChunk)
	}
	f := c.rest[k : k+int(n)]
	c.rest = c.rest[k+int(n):]
	return f, nil
}
