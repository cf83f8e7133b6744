-- 0006_refund_wall: when an event's own refund (not an attempt's: an
-- operator's, or an embedded client's) was decided, by the refunding node's
-- clock. A retry of the event another owner charged before that moment and
-- settled after the refund is covered by it (not billed); one charged after
-- it is a retry after the refund and takes the event over (billed). NULL:
-- an attempt's refund, a tombstone, or a row refunded before this column
-- (a late retry takes those over, as before).
ALTER TABLE events ADD COLUMN refund_wall timestamptz;
