-- 0007_replays: retries an owner answered Replayed (billed once, served
-- again), counted on their event like the retries other owners charged
-- (served_again), so that an attempt's refund that reaches the account's next
-- owner does not un-bill a served replay (see flush/replay.go).
--   replays:          replays counted on the event and not taken back.
--   replay_takebacks: replays taken back (at any owner) before the replay's own
--                     record settled; the replay, settling, is cancelled by one.
ALTER TABLE events ADD COLUMN replays integer NOT NULL DEFAULT 0;

CREATE TABLE replay_takebacks (
    account_id   text    NOT NULL,
    event_id     text    NOT NULL,
    period_start date    NOT NULL,
    node_id      text    NOT NULL,  -- the node that answered the replays
    count        integer NOT NULL,
    PRIMARY KEY (account_id, event_id, period_start, node_id)
);
