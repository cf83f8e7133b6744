-- 0003_served_again: retries served by other nodes while an event stood
-- billed (duplicates caught at settle), and refunds held back because of
-- them (see Batch in ledger.go).
--   served_again:   retries of the event another node charged and served
--   refund_pending: the event's own node asked to refund it while
--                   served_again > 0; it applies when those retries are
--                   refunded in turn
ALTER TABLE events ADD COLUMN served_again INTEGER NOT NULL DEFAULT 0;
ALTER TABLE events ADD COLUMN refund_pending INTEGER NOT NULL DEFAULT 0;
