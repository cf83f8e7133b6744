-- 0001_init: the ledger's tables (Postgres).
--
-- Money is bigint units, never floats. Times are timestamptz (UTC; Postgres
-- keeps microseconds, so a Unix-ns wall reading loses its last three digits
-- here). schema_migrations is created by the migrator itself, before this
-- file runs, so that it can read the version first.

-- Config: plans, accounts, keys, grants, route weights. Every admin change
-- bumps config_version in the same transaction.
CREATE TABLE plans (
    plan_id       text PRIMARY KEY,
    rate          text    NOT NULL DEFAULT '',  -- "10/s", "600/m", "" (no limit); snapshot.ParseRate
    burst         bigint  NOT NULL DEFAULT 0,
    monthly_quota bigint  NOT NULL DEFAULT 0,
    hard          boolean NOT NULL DEFAULT true
);

CREATE TABLE accounts (
    account_id text PRIMARY KEY,
    plan_id    text NOT NULL REFERENCES plans
);
CREATE INDEX accounts_plan ON accounts (plan_id);

-- A key is stored as the hex SHA-256 of its plaintext, never the plaintext.
CREATE TABLE api_keys (
    key_id     text PRIMARY KEY,
    key_hash   text        NOT NULL UNIQUE,
    account_id text        NOT NULL REFERENCES accounts,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);

-- A grant is units an account can spend between starts_at and expires_at
-- (NULL: never). Grant ids are scoped by account; a plan's monthly quota
-- becomes the grant "m:2026-06" of each period, created on first use.
-- used + reserved <= units is kept by the conditional update in Reserve, not
-- by a CHECK: soft plans record overage on the monthly grant (used > units),
-- and a refund that arrives before its charge may briefly count units
-- reserved twice.
CREATE TABLE grants (
    account_id text        NOT NULL REFERENCES accounts,
    grant_id   text        NOT NULL,
    kind       text        NOT NULL CHECK (kind IN ('monthly', 'credit')),
    period     text,  -- monthly grants: "2026-06"
    units      bigint      NOT NULL CHECK (units >= 0),
    used       bigint      NOT NULL DEFAULT 0,
    reserved   bigint      NOT NULL DEFAULT 0 CHECK (reserved >= 0),  -- = sum(reservations.units)
    starts_at  timestamptz NOT NULL,
    expires_at timestamptz,
    PRIMARY KEY (account_id, grant_id),
    CHECK ((kind = 'monthly') = (period IS NOT NULL)),
    CHECK (expires_at IS NULL OR expires_at > starts_at)
);

-- Each node's hold on each grant.
CREATE TABLE reservations (
    account_id text   NOT NULL,
    grant_id   text   NOT NULL,
    node_id    text   NOT NULL,
    units      bigint NOT NULL CHECK (units >= 0),
    PRIMARY KEY (account_id, grant_id, node_id),
    FOREIGN KEY (account_id, grant_id) REFERENCES grants
);
CREATE INDEX reservations_node ON reservations (node_id);

-- The settled mark of each (node, incarnation): the log position up to which
-- its records are in the ledger.
CREATE TABLE nodes (
    node_id      text        NOT NULL,
    incarnation  text        NOT NULL,
    settled_seq  bigint      NOT NULL DEFAULT 0 CHECK (settled_seq >= 0),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node_id, incarnation)
);

-- Route weights, versioned; one version is active.
CREATE TABLE route_versions (
    version       bigint      PRIMARY KEY,
    default_units bigint      NOT NULL CHECK (default_units >= 0),
    created_at    timestamptz NOT NULL DEFAULT now(),
    active        boolean     NOT NULL DEFAULT false
);
CREATE UNIQUE INDEX route_versions_one_active ON route_versions (active) WHERE active;

CREATE TABLE route_weights (
    version bigint NOT NULL REFERENCES route_versions,
    pattern text   NOT NULL,
    units   bigint NOT NULL,
    PRIMARY KEY (version, pattern)
);

-- Daily usage aggregates by UTC day. A refund subtracts on the day of its
-- charge.
CREATE TABLE usage_daily (
    account_id text   NOT NULL,
    key_id     text   NOT NULL,
    route      text   NOT NULL,
    day        date   NOT NULL,
    units      bigint NOT NULL DEFAULT 0,
    requests   bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (account_id, key_id, route, day)
);

-- The event log: one row per charge, partitioned by month (range on
-- period_start, the first day of the charge's period). Partitions are
-- created on demand by the settler (events_pYYYY_MM), outside the settle
-- transaction.
--
-- NB: a unique index on a partitioned table must include the partition key,
-- so the key is (account_id, event_id, period_start): the ledger catches a
-- duplicate event id within one month. A retry that crosses a month boundary
-- and reaches a new owner after a failover (charged in 2026-06 on one node,
-- again in 2026-07 on another) is billed twice: the documented exception to
-- G3.
--
-- A tombstone is a refund that arrived before its charge (the charge was
-- still in another node's unsettled log): refunded and tombstone are true, so
-- the charge, when it arrives, is a duplicate and never billed.
CREATE TABLE events (
    account_id   text        NOT NULL,
    event_id     text        NOT NULL,
    client_id    boolean     NOT NULL,  -- event_id came from Idempotency-Key
    key_id       text        NOT NULL,
    route        text        NOT NULL,
    units        bigint      NOT NULL,
    charged_at   timestamptz NOT NULL,
    period       text        NOT NULL,  -- "2026-06"
    period_start date        NOT NULL,
    node_id      text        NOT NULL,
    incarnation  text        NOT NULL,
    seq          bigint      NOT NULL,
    grant_ids    text[]      NOT NULL,  -- allocations: grant_ids[i] paid grant_units[i]
    grant_units  bigint[]    NOT NULL,
    refunded     boolean     NOT NULL DEFAULT false,
    refunded_at  timestamptz,
    tombstone    boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (account_id, event_id, period_start)
) PARTITION BY RANGE (period_start);

-- Alerts sent: once per (account, period, threshold).
CREATE TABLE alerts (
    account_id text        NOT NULL,
    period     text        NOT NULL,
    threshold  integer     NOT NULL,
    sent_at    timestamptz NOT NULL,
    PRIMARY KEY (account_id, period, threshold)
);

-- One row: the config version, bumped by every admin change.
CREATE TABLE config_version (
    id      integer PRIMARY KEY CHECK (id = 1),
    version bigint  NOT NULL
);
INSERT INTO config_version (id, version) VALUES (1, 0);
