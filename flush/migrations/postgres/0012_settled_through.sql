-- 0012_settled_through: the ledger's time up to which a node's log held
-- nothing unsettled: set by a settle that took everything durable when it
-- was read, and by a heartbeat with nothing unsettled. A month is final for
-- a node once this is a minute past its end (SettledMonth). heartbeat_at
-- served for it before, but a heartbeat goes on while settles fail, and a
-- month then read final with the node's charges of it still in its log.
-- NULL until a node on a build that knows it writes it; older builds' rows
-- are judged by heartbeat_at, as before.
ALTER TABLE nodes ADD COLUMN settled_through timestamptz;
