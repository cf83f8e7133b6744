package wal

import (
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/cockroachdb/pebble/v2"
)

// Scan calls fn for each record with after < seq <= min(upto, DurableSeq()),
// in sequence order. payload is valid only during fn. A frame that fails its
// checksum or has an unknown version stops the scan with an error wrapping
// ErrCorrupt that names the data dir and the sequence. An error from fn stops
// the scan and is returned as is. fn must not call Close.
func (l *Log) Scan(after, upto uint64, fn func(seq uint64, payload []byte) error) error {
	if err := l.acquire(); err != nil {
		return err
	}
	defer l.release()
	return l.iterRecords(after, min(upto, l.DurableSeq()), fn)
}

// iterRecords calls fn for each record in (after, upto], checking its key
// and frame. Records live in chunks keyed by their first sequence: the scan
// starts at the chunk holding after+1 and skips what is at or below after.
func (l *Log) iterRecords(after, upto uint64, fn func(seq uint64, payload []byte) error) error {
	if after >= upto {
		return nil
	}
	it, err := l.db.NewIter(&pebble.IterOptions{
		LowerBound: recordKey(0),
		UpperBound: recordKeyAfter(upto),
	})
	if err != nil {
		return l.pebbleError("scan records", err)
	}
	valid := it.SeekLT(recordKeyAfter(after + 1))
	if !valid {
		valid = it.First()
	}
	err = l.eachRecord(it, valid, after, upto, fn)
	return closeAfter(err, it)
}

// eachRecord runs fn over the records of the chunks of it in (after, upto].
func (l *Log) eachRecord(it *pebble.Iterator, valid bool, after, upto uint64, fn func(seq uint64, payload []byte) error) error {
	for ; valid; valid = it.Next() {
		first, err := parseRecordKey(it.Key())
		if err != nil {
			return corruptKey(l.opts.Dir, "record key", err)
		}
		v, err := it.ValueAndErr()
		if err != nil {
			return l.pebbleError(fmt.Sprintf("read records from seq %d", first), err)
		}
		c, err := openChunk(v)
		if err != nil {
			return corruptRecord(l.opts.Dir, first, err)
		}
		for i := uint64(0); i < c.count; i++ {
			seq := first + i
			frame, err := c.next()
			if err != nil {
				return corruptRecord(l.opts.Dir, seq, err)
			}
			if seq <= after {
				continue
			}
			if seq > upto {
				return nil
			}
			payload, err := decodeFrame(frame)
			if err != nil {
				return corruptRecord(l.opts.Dir, seq, err)
			}
			if err := fn(seq, payload); err != nil {
				return err
			}
		}
	}
	if err := it.Error(); err != nil {
		return l.pebbleError("read records", err)
	}
	return nil
}

// lastOfChunkAt returns the last sequence of the chunk holding seq (0 when
// no chunk starts at or before seq).
func (l *Log) lastOfChunkAt(seq uint64) (first, last uint64, err error) {
	it, err := l.db.NewIter(&pebble.IterOptions{LowerBound: recordKey(0), UpperBound: recordKeyAfter(seq)})
	if err != nil {
		return 0, 0, l.pebbleError("find the chunk of a record", err)
	}
	defer it.Close()
	if !it.Last() {
		if err := it.Error(); err != nil {
			return 0, 0, l.pebbleError("find the chunk of a record", err)
		}
		return 0, 0, nil
	}
	first, err = parseRecordKey(it.Key())
	if err != nil {
		return 0, 0, corruptKey(l.opts.Dir, "record key", err)
	}
	v, err := it.ValueAndErr()
	if err != nil {
		return 0, 0, l.pebbleError(fmt.Sprintf("read the chunk from seq %d", first), err)
	}
	c, err := openChunk(v)
	if err != nil {
		return 0, 0, corruptRecord(l.opts.Dir, first, err)
	}
	return first, first + c.count - 1, nil
}

// GetMeta returns a copy of the meta value name, and whether it exists.
func (l *Log) GetMeta(name string) ([]byte, bool, error) {
	if err := l.acquire(); err != nil {
		return nil, false, err
	}
	defer l.release()
	return l.getMeta(name)
}

func (l *Log) getMeta(name string) ([]byte, bool, error) {
	v, closer, err := l.db.Get(prefixKey(prefixMeta, name))
	if errors.Is(err, pebble.ErrNotFound) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, l.pebbleError(fmt.Sprintf("get meta %q", name), err)
	}
	defer closer.Close()
	payload, err := decodeFrame(v)
	if err != nil {
		return nil, false, corruptKey(l.opts.Dir, fmt.Sprintf("meta %q", name), err)
	}
	return append([]byte(nil), payload...), true, nil
}

// PutMeta stores v under name, synced. Names starting with "wal." belong to
// the log itself and are refused.
func (l *Log) PutMeta(name string, v []byte) error {
	if name == "" || strings.HasPrefix(name, reservedMetaPrefix) {
		return fmt.Errorf("wal: meta name %q is empty or reserved", name)
	}
	return l.write(func(b *pebble.Batch) error {
		return b.Set(prefixKey(prefixMeta, name), encodeFrame(v), nil)
	})
}

// write fills a batch with fill and commits it synced, whatever NoSync says.
func (l *Log) write(fill func(b *pebble.Batch) error) error {
	if l.readOnly {
		return errReadOnly(l.opts.Dir)
	}
	if err := l.acquire(); err != nil {
		return err
	}
	defer l.release()
	if err := l.waitErr(); err != nil && !errors.Is(err, ErrClosed) {
		return err
	}
	b := l.db.NewBatch()
	defer b.Close()
	if err := fill(b); err != nil {
		return err
	}
	if err := l.commitBatchSync(b); err != nil {
		return fmt.Errorf("wal: commit to %s: %w", l.opts.Dir, err)
	}
	return nil
}

// commitBatchSync commits b with pebble.Sync, turning a Fatalf panic into an
// error like commitBatch.
func (l *Log) commitBatchSync(b *pebble.Batch) (err error) {
	defer recoverFatal(&err)
	return b.Commit(pebble.Sync)
}

// closeAfter closes c and returns err, or the error of Close if err is nil,
// so that an error from a callback comes back unwrapped.
func closeAfter(err error, c io.Closer) error {
	if cerr := c.Close(); err == nil {
		return cerr
	}
	return err
}

// pebbleError wraps an error of a Pebble read; see the function pebbleError.
func (l *Log) pebbleError(what string, err error) error {
	return pebbleError(l.opts.Dir, l.opts.NodeID, what, err)
}
