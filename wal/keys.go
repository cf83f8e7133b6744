package wal

import (
	"encoding/binary"
	"fmt"
)

// Key prefixes. Each kind of key lives under its own one-byte prefix, so a
// bounded iterator over one prefix never sees another kind.
const (
	prefixRecord     = 'r' // 'r' + first seq of a chunk (8 bytes, big-endian)
	prefixCheckpoint = 'c' // 'c' + account
	prefixMeta       = 'm' // 'm' + name
	prefixIDs        = 'i' // 'i' + uvarint len(account) + account + kind byte + id
)

// idsMarkKind is the kind of an account's mark among its ids: its value is
// the seq of the checkpoint that last wrote them (see Checkpoint.IDs).
const idsMarkKind = 0

// idsPrefix is the prefix of an account's ids: the account is
// length-prefixed, so no account's prefix is another's.
func idsPrefix(account string) []byte {
	k := make([]byte, 0, 2+len(account))
	k = append(k, prefixIDs)
	k = binary.AppendUvarint(k, uint64(len(account)))
	return append(k, account...)
}

// idKey is the key of an account's id of kind.
func idKey(account string, kind byte, id string) []byte {
	k := idsPrefix(account)
	k = append(k, kind)
	return append(k, id...)
}

// keyAfterPrefix is the smallest key greater than every key that starts
// with p.
func keyAfterPrefix(p []byte) []byte {
	end := append([]byte(nil), p...)
	for i := len(end) - 1; i >= 0; i-- {
		if end[i] != 0xff {
			end[i]++
			return end[:i+1]
		}
	}
	return nil // all 0xff: no upper bound
}

// recordKeyLen is the length of every record key.
const recordKeyLen = 1 + 8

// Meta names that wal itself owns. PutMeta refuses names with this prefix.
const (
	reservedMetaPrefix = "wal."
	metaNodeID         = "wal.node_id"
	metaIncarnation    = "wal.incarnation"
	metaSettledSeq     = "wal.settled_seq"
	metaFormat         = "wal.format"
)

// formatVersion is the layout of keys and values described in doc.go. It is
// stored in meta when the dir is created; Open refuses any other.
// Version 2 keys chunks of records by their first sequence.
const formatVersion = 2

// putRecordKey writes the key of seq into dst, which has recordKeyLen bytes.
func putRecordKey(dst []byte, seq uint64) {
	dst[0] = prefixRecord
	binary.BigEndian.PutUint64(dst[1:], seq)
}

// recordKey returns the key of the record seq.
func recordKey(seq uint64) []byte {
	k := make([]byte, recordKeyLen)
	putRecordKey(k, seq)
	return k
}

// recordKeyAfter returns the smallest key greater than recordKey(seq). As
// every record key has the same length, [recordKey(a), recordKeyAfter(b))
// holds exactly the records a..b, and no seq overflows.
func recordKeyAfter(seq uint64) []byte {
	return append(recordKey(seq), 0)
}

// parseRecordKey returns the seq of a record key.
func parseRecordKey(k []byte) (uint64, error) {
	if len(k) != recordKeyLen || k[0] != prefixRecord {
		return 0, fmt.Errorf("malformed record key %x", k)
	}
	return binary.BigEndian.Uint64(k[1:]), nil
}

// prefixKey returns prefix followed by name.
func prefixKey(prefix byte, name string) []byte {
	k := make([]byte, 0, 1+len(name))
	return append(append(k, prefix), name...)
}

// prefixEnd returns the exclusive upper bound of all keys under prefix.
func prefixEnd(prefix byte) []byte {
	return []byte{prefix + 1}
}

// encodeU64 returns v as 8 big-endian bytes.
func encodeU64(v uint64) []byte {
	return binary.BigEndian.AppendUint64(nil, v)
}

// decodeU64 reads 8 big-endian bytes.
func decodeU64(b []byte) (uint64, error) {
	if len(b) != 8 {
		return 0, fmt.Errorf("want 8 bytes, have %d", len(b))
	}
	return binary.BigEndian.Uint64(b), nil
}
