-- 0013_served_by_owed: served_again by node (see owed.go and Batch in
-- ledger.go), one entry per retry or debt:
--   served_by: the nodes whose retries count as served again
--   owed:      the nodes whose late charges the event is owed (the refund
--              of a retry another node charged settled first): only that
--              node's charge pays the debt back
-- served_again stays their net count. Rows of older builds have no names:
-- their counts stay unnamed and are read as before.
ALTER TABLE events ADD COLUMN served_by text[] NOT NULL DEFAULT '{}';
ALTER TABLE events ADD COLUMN owed text[] NOT NULL DEFAULT '{}';
