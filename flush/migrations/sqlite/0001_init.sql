-- 0001_init: the ledger's tables (SQLite).
--
-- The same tables as the Postgres schema, with SQLite's types: times are
-- INTEGER Unix nanoseconds (NULL expires_at: never), days are TEXT
-- 'YYYY-MM-DD', booleans are INTEGER 0/1, and an event's allocations are JSON
-- text: [{"grant":"m:2026-06","units":3}, ...]. The event log is one table
-- (no partitions), so its unique (account_id, event_id) catches duplicates
-- across months too. schema_migrations is created by the migrator.

CREATE TABLE plans (
    plan_id       TEXT PRIMARY KEY,
    rate          TEXT    NOT NULL DEFAULT '',
    burst         INTEGER NOT NULL DEFAULT 0,
    monthly_quota INTEGER NOT NULL DEFAULT 0,
    hard          INTEGER NOT NULL DEFAULT 1
);

CREATE TABLE accounts (
    account_id TEXT PRIMARY KEY,
    plan_id    TEXT NOT NULL REFERENCES plans
);
CREATE INDEX accounts_plan ON accounts (plan_id);

CREATE TABLE api_keys (
    key_id     TEXT PRIMARY KEY,
    key_hash   TEXT    NOT NULL UNIQUE,
    account_id TEXT    NOT NULL REFERENCES accounts,
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
);

CREATE TABLE grants (
    account_id TEXT    NOT NULL REFERENCES accounts,
    grant_id   TEXT    NOT NULL,
    kind       TEXT    NOT NULL CHECK (kind IN ('monthly', 'credit')),
    period     TEXT,
    units      INTEGER NOT NULL CHECK (units >= 0),
    used       INTEGER NOT NULL DEFAULT 0,
    reserved   INTEGER NOT NULL DEFAULT 0 CHECK (reserved >= 0),
    starts_at  INTEGER NOT NULL,
    expires_at INTEGER,
    PRIMARY KEY (account_id, grant_id),
    CHECK ((kind = 'monthly') = (period IS NOT NULL)),
    CHECK (expires_at IS NULL OR expires_at > starts_at)
);

CREATE TABLE reservations (
    account_id TEXT    NOT NULL,
    grant_id   TEXT    NOT NULL,
    node_id    TEXT    NOT NULL,
    units      INTEGER NOT NULL CHECK (units >= 0),
    PRIMARY KEY (account_id, grant_id, node_id),
    FOREIGN KEY (account_id, grant_id) REFERENCES grants
);
CREATE INDEX reservations_node ON reservations (node_id);

CREATE TABLE nodes (
    node_id      TEXT    NOT NULL,
    incarnation  TEXT    NOT NULL,
    settled_seq  INTEGER NOT NULL DEFAULT 0 CHECK (settled_seq >= 0),
    heartbeat_at INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    PRIMARY KEY (node_id, incarnation)
);

CREATE TABLE route_versions (
    version       INTEGER PRIMARY KEY,
    default_units INTEGER NOT NULL CHECK (default_units >= 0),
    created_at    INTEGER NOT NULL,
    active        INTEGER NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX route_versions_one_active ON route_versions (active) WHERE active;

CREATE TABLE route_weights (
    version INTEGER NOT NULL REFERENCES route_versions,
    pattern TEXT    NOT NULL,
    units   INTEGER NOT NULL,
    PRIMARY KEY (version, pattern)
);

CREATE TABLE usage_daily (
    account_id TEXT    NOT NULL,
    key_id     TEXT    NOT NULL,
    route      TEXT    NOT NULL,
    day        TEXT    NOT NULL,
    units      INTEGER NOT NULL DEFAULT 0,
    requests   INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (account_id, key_id, route, day)
);

CREATE TABLE events (
    account_id  TEXT    NOT NULL,
    event_id    TEXT    NOT NULL,
    client_id   INTEGER NOT NULL,
    key_id      TEXT    NOT NULL,
    route       TEXT    NOT NULL,
    units       INTEGER NOT NULL,
    charged_at  INTEGER NOT NULL,
    period      TEXT    NOT NULL,
    node_id     TEXT    NOT NULL,
    incarnation TEXT    NOT NULL,
    seq         INTEGER NOT NULL,
    allocations TEXT    NOT NULL,
    refunded    INTEGER NOT NULL DEFAULT 0,
    refunded_at INTEGER,
    tombstone   INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (account_id, event_id)
);

CREATE TABLE alerts (
    account_id TEXT    NOT NULL,
    period     TEXT    NOT NULL,
    threshold  INTEGER NOT NULL,
    sent_at    INTEGER NOT NULL,
    PRIMARY KEY (account_id, period, threshold)
);

CREATE TABLE config_version (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    version INTEGER NOT NULL
);
INSERT INTO config_version (id, version) VALUES (1, 0);
